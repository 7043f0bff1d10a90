"""Parameters on the host between uses (TIERFLOW_OFFLOAD_PARAMS=host): the module hooks that tell
tiering::ParamSchedule when each unit is used, on an unchanged model.

Note [Parameter hooks]
~~~~~~~~~~~~~~~~~~~~~~
The schedule (Note [Parameter residency] in tiering/param_schedule.hpp) decides
what moves; _C.ParamResidency carries it out on the parameters' storages (Note
[Parameter storage]); this module only says when a unit is used. Units: the
repeated blocks (find_blocks, or the blocks given to wrap) and the rest unit,
every parameter outside them (embeddings, final norm, head; a parameter a
block shares with the rest, such as a tied weight, is fetched once).

Forward. The model's pre-hook opens a use of the rest unit. A block's pre-hook
(run before any other: the activation plans' hooks may record its ops) closes
the open use and opens the block's; its forward hook (run after the others)
closes it and opens the rest unit again, so whatever runs between and after
the blocks (a final norm, the head, a weight read outside any module) finds
the rest unit's parameters on the device. The model's forward hook closes the
last use: every fetched parameter is then released.
Backward. The gradient of the model's output opens the rest unit (the loss
and the head); the gradient of a block's output opens the block (before any
of its backward runs, so before a replay of Note [Activation plans] or a
gradient checkpoint's recompute, which run its forward again: a block's
pre-hook during backward does nothing); the gradient of a block's input
closes it and opens the rest unit; the end of backward (a callback queued on
the engine when it starts) closes what is open. A forward run during
backward (a recompute) changes nothing.
Everything else. With a torch optimizer (offload_optimizer="none") step()
runs with every parameter pointing at its host copy, which it updates in
place; on the emulated device only, whose device tensors are CPU tensors (on
CUDA the gradients are on the device: use the CPU optimizer, which steps the
host copies and never reads the device). tierflow's CPUAdamW steps the host
copies. state_dict() holds the host copies (CPU tensors); load_state_dict()
fetches each module's parameters, lets the module load them and writes them
back to the host copies.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from . import _C
from ._compile import outside_graphs
from .activations.blocks import find_blocks


def _in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (a recompute's forward)."""
    return torch._C._current_graph_task_id() != -1


class ParamOffload:
    """The parameter hooks of one wrapped model (Note [Parameter hooks])."""

    def __init__(self, session: Any, model: torch.nn.Module, blocks: Optional[list]) -> None:
        blocks = list(blocks) if blocks is not None else find_blocks(model)
        if not blocks:
            raise _C.ConfigError(
                f"offload_params: found no repeated blocks in {type(model).__name__} (Note [Finding blocks]); "
                "pass blocks=[...] to tierflow.wrap, or use offload_params='none'")
        names = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        units: list = []
        seen: set = set()
        for block in blocks:
            units.append([p for p in block.parameters()])
            seen.update(id(p) for p in units[-1])
        units.append([p for p in model.parameters() if id(p) not in seen])
        self.rest = len(blocks)
        self._params = [p for u in units for p in u]
        self._ids = {id(p) for p in self._params}
        self.rest_bytes = sum(p.numel() * p.element_size() for p in units[-1])
        self._runtime = session.runtime
        self.impl = _C.ParamResidency(session.runtime, units, ["host"] * len(units),
                                      [names.get(id(p), "?") for u in units for p in u])
        self._model = weakref.ref(model)
        self._open: Optional[tuple] = None  # (unit, backward) of the use in progress
        self._handles: list = []
        me = weakref.ref(self)

        def call(method: str, *args: Any) -> Any:
            offload = me()
            return getattr(offload, method)(*args) if offload is not None else None

        hook = outside_graphs  # Note [Hooks outside graphs]
        self._handles.append(model.register_forward_pre_hook(
            hook(lambda m, a: call("_model_begins")), prepend=True))
        self._handles.append(model.register_forward_hook(
            hook(lambda m, a, out: call("_model_ends", out)), always_call=True))
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(
                hook(lambda m, a, kw, i=i: call("_block_begins", i, a, kw)), prepend=True, with_kwargs=True))
            self._handles.append(block.register_forward_hook(
                hook(lambda m, a, out, i=i: call("_block_ends", i, out)), always_call=True))
        self._handles += self._state_dict_hooks(model, me)

    def __hash__(self) -> int:
        return id(self)

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of these parameters."""
        return any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])

    def remove(self) -> None:
        """Removes the hooks and gives every parameter its device memory and value back (unwrap)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._switch(None, self._open is not None and self._open[1])
        self.impl.point_at_host(False)
        for p in self._params:
            self.impl.materialize(p, True)
        _live.discard(self)

    def adopt_optimizer(self, cpu_optimizer: Any) -> None:
        """tierflow's CPUAdamW steps the host copies; any other optimizer over these parameters steps them
        pointed at their host copies where the device allows it (_torch_optimizer_step), else is refused then."""
        if cpu_optimizer is not None:
            cpu_optimizer.use_host_copies(self)
        _install_step_hooks()
        _live.add(self)

    # -- uses --------------------------------------------------------------------------------------
    def _switch(self, unit: Optional[int], backward: bool) -> None:
        """Closes the open use and opens ``unit``'s (None: opens nothing)."""
        if self._open is not None:
            u, b = self._open
            (self.impl.end_backward if b else self.impl.end_forward)(u)
            self._open = None
        if unit is not None:
            (self.impl.begin_backward if backward else self.impl.begin_forward)(unit)
            self._open = (unit, backward)

    def _model_begins(self) -> None:
        if not _in_backward():
            self._switch(self.rest, False)

    def _model_ends(self, out: Any) -> None:
        if _in_backward():
            return
        self._switch(None, False)
        if torch.is_grad_enabled():
            self._on_grad(out, lambda: self._backward_begins())

    def _block_begins(self, i: int, args: Any, kwargs: Any) -> None:
        if _in_backward():
            return  # a recompute: the block's backward opened it
        self._switch(i, False)
        if torch.is_grad_enabled():  # its input's gradient closes its backward
            first = next((t for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(self._grad_hook(lambda: self._block_backward_ends(i)))

    def _block_ends(self, i: int, out: Any) -> None:
        if _in_backward():
            return
        self._switch(self.rest, False)
        if torch.is_grad_enabled():
            self._on_grad(out, lambda: self._block_backward_begins(i))

    # -- backward ----------------------------------------------------------------------------------
    def _on_grad(self, out: Any, then: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._grad_hook(then))

    @staticmethod
    def _grad_hook(then: Any) -> Any:
        def hook(grad: torch.Tensor) -> None:
            then()
        return hook

    def _backward_begins(self) -> None:
        if self._open == (self.rest, True):
            return  # another output of the model
        self._switch(self.rest, True)
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: me() is not None and me()._switch(None, True))

    def _block_backward_begins(self, i: int) -> None:
        if self._open != (i, True):
            self._switch(i, True)

    def _block_backward_ends(self, i: int) -> None:
        if self._open == (i, True):
            self._switch(self.rest, True)

    # -- outside forward and backward --------------------------------------------------------------
    def host_copy(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The host copy of ``p`` (what the optimizer steps), or None when ``p`` stays on the device."""
        return self.impl.host_copy(p)

    def point_at_host(self, on_host: bool) -> None:
        self.impl.point_at_host(on_host)

    def stats(self) -> dict:
        return self.impl.stats()

    def _state_dict_hooks(self, model: torch.nn.Module, me: Any) -> list:
        handles = []

        def saving(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            offload = me()
            if offload is None:
                return
            for name, p in module.named_parameters(recurse=False):
                host = offload.impl.host_copy(p)
                if host is not None and prefix + name in state_dict:
                    state_dict[prefix + name] = host.detach()

        def loading(module: torch.nn.Module, *args: Any) -> None:
            offload = me()
            if offload is not None:
                for p in module.parameters(recurse=False):
                    offload.impl.materialize(p, True)

        def loaded(module: torch.nn.Module, incompatible: Any) -> None:
            offload = me()
            if offload is not None:
                for p in module.parameters(recurse=False):
                    offload.impl.materialize(p, False)

        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                handles.append(module._register_state_dict_hook(saving))
                handles.append(module._register_load_state_dict_pre_hook(loading))
                handles.append(module.register_load_state_dict_post_hook(loaded))
        return handles


# -- torch optimizers over offloaded parameters ----------------------------------------------------
# Note [Parameter hooks], "Everything else": any torch optimizer (made before or after wrap) steps the host
# copies, through torch's global step hooks; tierflow's CPUAdamW steps them itself.
_live: "weakref.WeakSet[ParamOffload]" = weakref.WeakSet()
_hooks_installed = False


def _offloads_of(optimizer: torch.optim.Optimizer) -> list:
    from .optim import CPUAdamW

    if isinstance(optimizer, CPUAdamW):
        return []
    return [o for o in list(_live) if o.holds(optimizer)]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for offload in _offloads_of(optimizer):
        why = offload._runtime.params_optimizer_refusal(False)
        if why is not None:
            raise _C.ConfigError(f"{why} ({type(optimizer).__name__} steps them)")
        offload.point_at_host(True)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for offload in _offloads_of(optimizer):
        offload.point_at_host(False)


def _install_step_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True
