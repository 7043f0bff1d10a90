"""Parameters on the host or NVMe between uses (TIERFLOW_OFFLOAD_PARAMS=host|nvme): the module hooks that tell
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
closes it. A module of the rest unit that runs after a block (a final norm,
the head) opens the rest unit again. So a forward's uses are rest, the
blocks, rest: the order the schedule expects before any record, and the
rest unit, used again at the end, stays on the device through the forward
(a weight read outside any module between blocks finds it there). The
model's forward hook closes the last use and ends the phase: every fetched
parameter is then released.
Backward. The gradient of the model's output opens the rest unit, which
stays until the end of backward (the head first, the embeddings last, a
norm between an encoder's blocks and a decoder's). The gradient of a
block's output opens the block (before any of its backward runs, so before a
replay of Note [Activation plans] or a gradient checkpoint's recompute,
which run its forward again: a block's pre-hook during backward does
nothing). A block's use ends when the gradients of all its tensor inputs
are ready (an input that is the previous block's output is counted by that
block's output hook, before the previous block begins, so that two blocks
and the prefetched one at most are on the device): autograd reads a weight only to compute the gradient of what
the weight multiplied, and everything a block computes flows out through its
inputs or into its own parameters' gradients (which need the activations,
not the weight), so nothing of the block can need its parameters after that.
Uses may overlap (a decoder block's cross-attention input, the encoder's
output, is ready only after every decoder block). The end of backward (a
callback queued on the engine when it starts) ends what is still open, the
rest unit last, and the phase, which releases whatever is left (Note
[Parameter residency]: a block whose inputs need no gradient, such as the
first of a model with frozen embeddings; a prefetch for a use that did not
come). The model's forward hook ends the forward phase the same way.
Auto. With TIERFLOW_OFFLOAD_PARAMS=auto every unit is fetched from the host
during the two steps the activation planner measures; its plan (Note
[Activation planner], Parameters: which units keep their parameters,
within TIERFLOW_GPU_MEMORY, together with the activations) is applied when
the forward it was made in ends: those units' parameters are copied to the
device once and stay (ParamSchedule::make_resident), and the optimizer
steps them there from then on.
Everything else. With a torch optimizer (offload_optimizer="none") step()
runs with every parameter pointing at its host copy (NVMe: read into a host
tensor, written back after the step), which it updates in place; on the
emulated device only, whose device tensors are CPU tensors (on CUDA the
gradients are on the device: use the CPU optimizer, which steps the host
copies and never reads the device). tierflow's CPUAdamW steps the host copies
(NVMe: it writes each new value there in step(); those parameters step after
backward, not during it). state_dict() holds the values on the host (CPU
tensors); load_state_dict() fetches each module's parameters, lets the
module load them and writes them back.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from . import _C
from ._compile import outside_graphs
from ._distributed import _ddp_around, _ddp_inside
from .activations.blocks import find_blocks
from ._param_state import state_hooks


_DDP_REFUSAL = ("TIERFLOW_OFFLOAD_PARAMS (host or nvme) under torch.nn.parallel.DistributedDataParallel (DDP): not "
                "supported yet (DDP broadcasts and reads the parameters themselves, which live off the device "
                "between uses); accepted under DDP: TIERFLOW_OFFLOAD_PARAMS=none")


def _in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (a recompute's forward)."""
    return torch._C._current_graph_task_id() != -1


class ParamOffload:
    """The parameter hooks of one wrapped model (Note [Parameter hooks])."""

    def __init__(self, session: Any, model: torch.nn.Module, blocks: Optional[list]) -> None:
        if _ddp_inside(model) is not None:
            raise _C.ConfigError(_DDP_REFUSAL)
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
        setting = session.config["TIERFLOW_OFFLOAD_PARAMS"]
        self.planned = setting == "auto"  # every unit fetched from the host until the plan says which stay
        self.tier = "host" if self.planned else setting
        self.impl = _C.ParamResidency(session.runtime, units, [self.tier] * len(units),
                                      [names.get(id(p), "?") for u in units for p in u])
        self._model = weakref.ref(model)
        self._open: Optional[int] = None  # the forward use in progress
        self._backward: Optional[set] = None  # in a backward: its blocks whose use is open
        self._pending: dict = {}  # block -> gradients of its inputs backward has still to produce
        self._awaiting: dict = {}  # key of one input's gradient -> the block waiting for it
        self._next_key = 0
        self._resident: Optional[list] = None  # auto: the units the plan keeps on the device, until applied
        self._optimizer: Optional[Any] = None  # weak reference to the CPUAdamW stepping these parameters
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
        inside = {id(m) for block in blocks for m in block.modules()}
        for module in model.modules():
            if id(module) not in inside and module is not model and \
                    any(True for _ in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_pre_hook(hook(lambda m, a: call("_rest_module_begins"))))
        self._handles += state_hooks(model, me)  # Note [Parameter state]

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of these parameters."""
        return any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])

    def remove(self) -> None:
        """Removes the hooks and gives every parameter its device memory and value back (unwrap)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._switch(None)
        self._close_backward()
        self.impl.point_at_host(False)
        self.impl.end_phase()
        # Every unit resident: the parameters get their memory and values back, and the optimizer that
        # stepped their host copies steps them on the device again.
        self._make_resident(list(range(self.rest + 1)))
        _live.discard(self)

    def adopt_optimizer(self, cpu_optimizer: Any) -> None:
        """tierflow's CPUAdamW steps the host copies; any other optimizer over these parameters steps them
        pointed at their host copies where the device allows it (_torch_optimizer_step), else is refused then."""
        if cpu_optimizer is not None:
            cpu_optimizer.use_host_copies(self)
            self._optimizer = weakref.ref(cpu_optimizer)
        _install_step_hooks()
        _live.add(self)

    # -- forward: one use at a time ----------------------------------------------------------------
    def _switch(self, unit: Optional[int]) -> None:
        """Closes the open forward use and opens ``unit``'s (None: opens nothing)."""
        if self._open is not None:
            self.impl.end_forward(self._open)
            self._open = None
        if unit is not None:
            self.impl.begin_forward(unit)
            self._open = unit

    def _model_begins(self) -> None:
        model = self._model()
        if model is not None and _ddp_around(model) is not None:  # DDP(model) after wrap
            raise _C.ConfigError(_DDP_REFUSAL)
        if not _in_backward():
            self._close_backward()  # a backward that never reached its end (an error): its phase ends here
            self._pending, self._awaiting = {}, {}
            self._switch(self.rest)

    def _rest_module_begins(self) -> None:
        """A module holding parameters of the rest unit runs between blocks (a final norm, the head)."""
        if self._open is None and not _in_backward():
            self._switch(self.rest)

    def _model_ends(self, out: Any) -> None:
        if _in_backward():
            return
        self._switch(None)
        self.impl.end_phase()
        if self._resident is not None:  # between phases: the plan's resident units
            self._make_resident(self._resident)
            self._resident = None
        if torch.is_grad_enabled():
            self._on_grad(out, self._backward_begins)

    def _block_begins(self, i: int, args: Any, kwargs: Any) -> None:
        if _in_backward():
            # A recompute. Its block's backward opened it, unless the block's forward ran under no_grad (a
            # reentrant checkpoint: no output hook was registered): then the recompute opens it, and the
            # gradients of the recompute's inputs close it.
            if self._backward is not None and i not in self._backward:
                self._block_backward_begins(i)
                self._await_inputs(i, args, kwargs)
            return
        self._switch(i)
        self._await_inputs(i, args, kwargs)

    def _await_inputs(self, i: int, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled():  # the gradients of its inputs close its backward
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            self._pending[i] = self._pending.get(i, 0) + len(inputs)
            for t in inputs:
                key = self._next_key
                self._next_key += 1
                self._awaiting[key] = i
                # The previous block's output hook, registered first, reads these keys (_output_grad).
                t.__dict__.setdefault("_tierflow_awaiting", []).append(key)
                t.register_hook(self._grad_hook(lambda key=key: self._input_grad_ready(key)))

    def _block_ends(self, i: int, out: Any) -> None:
        if _in_backward():
            return
        self._switch(None)  # what runs next opens its unit: a block, or a module of the rest unit
        if torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    # The keys of the blocks that will take t as input (_block_begins adds them); the list, not
                    # the tensor, whose hooks must not keep it alive (and whose Python object may go first).
                    keys = t.__dict__.setdefault("_tierflow_awaiting", [])
                    t.register_hook(self._grad_hook(lambda keys=keys: self._output_grad(i, keys)))

    # -- backward: uses that may overlap --------------------------------------------------------------
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
        if self._backward is not None:
            return  # another output of the model
        if self._open is not None or torch.is_grad_enabled():
            # A backward inside a forward (autograd.grad in a block), or one that builds a graph of its own
            # (create_graph=True: double backward, gradient penalties), whose second pass reads the weights
            # after this one released them.
            raise _C.ConfigError(
                "offload_params: a backward " + ("inside the model's forward" if self._open is not None else
                                                 "with create_graph=True (double backward)") +
                " is not supported with parameters off the device; accepted: TIERFLOW_OFFLOAD_PARAMS=none")
        self._backward = set()
        self.impl.begin_backward(self.rest)
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: me() is not None and me()._close_backward())

    def _block_backward_begins(self, i: int) -> None:
        if self._backward is None:
            self._backward_begins()  # backward from a block's output, not the model's
        if i not in self._backward:
            self._backward.add(i)
            self.impl.begin_backward(i)

    def _output_grad(self, i: int, keys: list) -> None:
        """The gradient of block i's output is ready: the blocks that took the tensor as input (``keys``) stop
        waiting for it first (their own hooks, registered later, would run after this one), then block i's
        backward begins."""
        for key in keys:
            self._input_grad_ready(key)
        self._block_backward_begins(i)

    def _input_grad_ready(self, key: int) -> None:
        i = self._awaiting.pop(key, None)
        if i is None:
            return  # counted already, by the output hook of the block that made the tensor
        self._pending[i] -= 1
        if self._pending[i] == 0 and self._backward is not None and i in self._backward:
            self._backward.discard(i)
            self.impl.end_backward(i)

    def _close_backward(self) -> None:
        """The end of backward: every use still open ends, and the phase with them."""
        if self._backward is None:
            return
        open_uses, self._backward = self._backward, None  # whatever happens below, this backward is over
        try:
            for i in sorted(open_uses, reverse=True):
                self.impl.end_backward(i)
            self.impl.end_backward(self.rest)
        finally:
            self.impl.end_phase()

    # -- auto: the plan's residences ----------------------------------------------------------------
    def plan_residences(self, plan: dict) -> None:
        """TIERFLOW_OFFLOAD_PARAMS=auto: the units whose parameters the plan keeps on the device, made
        resident when the forward the plan was made in ends (between phases)."""
        units = [i for i, b in enumerate(plan["blocks"]) if b.get("params") == "gpu"]
        if plan.get("rest_params") == "gpu":
            units.append(self.rest)
        self._resident = units

    def _make_resident(self, units: list) -> None:
        params = self.impl.make_resident(units) if units else []
        self._ids -= {id(p) for p in params}
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is not None and params:
            opt.params_became_resident(params)
        _C.log("info", f"tierflow parameters: {len(units)} of {self.rest + 1} units resident from now on "
                       f"({sum(p.numel() * p.element_size() for p in params)} bytes)")

    # -- outside forward and backward --------------------------------------------------------------
    def host_copy(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The host copy of ``p`` on the host tier (the optimizer steps it in place), else None."""
        return self.impl.host_copy(p)

    def offloaded(self, p: torch.Tensor) -> bool:
        return self.impl.offloaded(p)

    def load(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s value between uses, on the host (its host copy, or read from NVMe)."""
        return self.impl.load(p)

    def store(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` (a contiguous CPU tensor of p's dtype and shape) becomes p's value between uses."""
        self.impl.store(p, value)

    def point_at_host(self, on_host: bool) -> None:
        self.impl.point_at_host(on_host)

    def stats(self) -> dict:
        return self.impl.stats()

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
