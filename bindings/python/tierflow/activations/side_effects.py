"""What a block's forward does besides computing its outputs, and putting it back around a replay
(Note [Replay side effects] in tiering/replay_rule.hpp: the decision is tiering::replay_refusal's; this module
finds the torch facts it is made from and restores what a replay would otherwise write twice)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch.nn.modules import module as _module

from .table import storage_key

# Code whose hooks are part of the forward, not a user's: tierflow's own (its runners, the session's, the
# parameter fetches) and torch's (spectral_norm's and weight_norm's pre-hooks, pruning, torch.ao's observers,
# FSDP2's), which compute from the module's state: what they write is compared like the forward's own writes.
_OWN_CODE = ("tierflow", "torch")


def _code_of(hook: Any) -> Any:
    """The function or object whose code a hook runs (through functools.partial, wraps and bound methods)."""
    for _ in range(16):
        if isinstance(hook, functools.partial):
            hook = hook.func
        elif getattr(hook, "__wrapped__", None) is not None:
            hook = hook.__wrapped__
        elif getattr(hook, "__func__", None) is not None:
            hook = hook.__func__
        else:
            break
    return hook


def _origin(hook: Any) -> str:
    code = _code_of(hook)
    module = getattr(code, "__module__", None) if callable(code) and hasattr(code, "__code__") else None
    return module or type(code).__module__ or ""


def replay_safe(hook: Any) -> Any:
    """Marks a forward hook or pre-hook as safe to call again when its block is recomputed in backward: it has
    no effect but on the tensors it returns (no counter, no statistics kept outside). A block whose only hooks
    of a user's are marked so is replayed as its plan says (Note [Replay side effects]). Returns the hook."""
    try:
        hook.__tierflow_replay_safe__ = True
        return hook
    except (AttributeError, TypeError):  # a bound method or a builtin: a function that calls it
        @functools.wraps(hook)
        def marked(*args: Any, **kwargs: Any) -> Any:
            return hook(*args, **kwargs)

        marked.__tierflow_replay_safe__ = True
        return marked


def _own(hook: Any) -> bool:
    if getattr(hook, "__tierflow_replay_safe__", False):
        return True
    origin = _origin(hook)
    return any(origin == p or origin.startswith(p + ".") for p in _OWN_CODE)


def _name(hook: Any) -> str:
    code = _code_of(hook)
    return getattr(code, "__qualname__", None) or type(code).__qualname__


def foreign_hooks(block: torch.nn.Module) -> list:
    """The forward hooks and pre-hooks a forward of ``block`` would call that are a user's: on it, on a
    submodule, or global (Note [Replay side effects])."""
    found = []
    for kind, hooks in (("global forward pre-hook", _module._global_forward_pre_hooks),
                        ("global forward hook", _module._global_forward_hooks)):
        found += [f"{kind} {_name(h)}" for h in hooks.values() if not _own(h)]
    for name, m in block.named_modules():
        for kind, hooks in (("forward pre-hook", m._forward_pre_hooks), ("forward hook", m._forward_hooks)):
            found += [f"{kind} {_name(h)} on {name or 'the block'}" for h in hooks.values() if not _own(h)]
    return found


def _dtensor_types() -> tuple:
    import sys

    dtensor = sys.modules.get("torch.distributed.tensor")
    return (getattr(dtensor, "DTensor"),) if dtensor is not None and hasattr(dtensor, "DTensor") else ()


class BlockState:
    """A block's parameters and buffers around one forward, and what a replay of it restores
    (Note [Replay side effects]).

    Taken before the forward: each slot (a parameter or buffer of the block or a submodule, by qualified name)
    and its tensor and version; copies of the values of the slots the block is known to write (``writes``,
    learned from earlier forwards) and, while the block is recorded, of any slot the Recorder sees written
    before its first write (``before_write``) and of every buffer (kept where its value changed). After the
    forward (``compare``): slots rebound to another tensor (buffers only: FSDP2 swaps parameters in and out),
    and slots written in place, by version counter."""

    def __init__(self, block: torch.nn.Module, writes: set, recording: bool = False) -> None:
        sharded = _dtensor_types()
        self.slots: dict = {}    # name -> (owner, attribute, "parameter" | "buffer", tensor, version)
        for kind, named in (("parameter", block.named_parameters(remove_duplicate=False)),
                            ("buffer", block.named_buffers(remove_duplicate=False))):
            for name, t in named:
                if t is None or (sharded and isinstance(t, sharded)):
                    continue
                owner_name, _, attr = name.rpartition(".")
                owner = block.get_submodule(owner_name) if owner_name else block
                self.slots[name] = (owner, attr, kind, t, t._version)
        # Tensors a module keeps as plain attributes (self.ema = torch.zeros(...), neither parameter nor buffer):
        # state its forward may write like a buffer's, restored the same way.
        for prefix, module in block.named_modules(remove_duplicate=False):
            for attr, t in vars(module).items():
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and \
                        not (sharded and isinstance(t, sharded)) and not t.is_inference():  # (no version counter)
                    self.slots[f"{prefix}.{attr}" if prefix else attr] = (module, attr, "attribute", t, t._version)
        self.copies: dict = {}   # name -> the slot's value before the forward
        self.rebound: dict = {}  # name -> the tensor the slot held before the forward (buffers rebound in it)
        # Recording: every buffer's value, compared after the forward. Some ops write their arguments without
        # saying so in their schema or bumping a version counter: native_batch_norm's running statistics.
        self.snapshots: dict = {}
        with torch.no_grad():
            for name in writes:
                if name in self.slots:
                    self.copies[name] = self.slots[name][3].detach().clone()
            if recording:
                for name, (_, _, kind, t, _) in self.slots.items():
                    if kind != "parameter" and name not in self.copies:
                        self.snapshots[name] = t.detach().clone()

    def guard(self) -> dict:
        """Storage key -> the slots on it, for the Recorder's before_write."""
        out: dict = {}
        for name, (_, _, _, t, _) in self.slots.items():
            if t.layout == torch.strided and t.device.type != "meta":
                out.setdefault(storage_key(t), []).append(name)
        return out

    def before_write(self, names: list) -> None:
        """The Recorder is about to write into these slots' storage: their values from before, once."""
        for name in names:
            if name not in self.copies:
                self.copies[name] = self.slots[name][3].detach().clone()

    def compare(self) -> list:
        """After the forward: the (kind, name) of the slots it wrote in place with no value kept from before (none when all can be
        restored). Rebound buffers are noted."""
        unrestorable = []
        for name, before in self.snapshots.items():
            if name not in self.copies and not torch.equal(before, self.slots[name][3]):
                self.copies[name] = before
        self.snapshots.clear()
        for name, (owner, attr, kind, t, version) in self.slots.items():
            now = _holder(owner, kind).get(attr)
            if kind != "parameter" and now is not t:
                self.rebound[name] = t
            if t._version != version and name not in self.copies:
                unrestorable.append((kind, name))
        return unrestorable

    def written(self) -> set:
        """The slots this forward wrote or rebound: what the block's later forwards keep a copy of."""
        return set(self.copies) | set(self.rebound)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """A replay's scope: the slots hold what they held before the forward; on leaving, what they held on
        entering (the forward's result, or a later forward's), version counters as they were."""
        undo: list = []
        try:
            with torch.no_grad():
                for name, t0 in self.rebound.items():
                    owner, attr, kind, _, _ = self.slots[name]
                    slots = _holder(owner, kind)
                    undo.append(("rebind", slots, attr, slots.get(attr)))
                    slots[attr] = t0
                for name, before in self.copies.items():
                    t = self.slots[name][3]
                    undo.append(("value", t, t.detach().clone(), t._version))
                    t.detach().copy_(before)
            yield
        finally:
            with torch.no_grad():
                for entry in reversed(undo):
                    if entry[0] == "rebind":
                        _, slots, attr, obj = entry
                        slots[attr] = obj
                    else:
                        _, t, value, version = entry
                        t.detach().copy_(value)
                        _set_version(t, version)


def _holder(owner: torch.nn.Module, kind: str) -> dict:
    """The dict a slot of ``kind`` lives in: the module's parameters, buffers, or plain attributes."""
    return owner._parameters if kind == "parameter" else owner._buffers if kind == "buffer" else vars(owner)


def _set_version(t: torch.Tensor, version: int) -> None:
    """Puts a tensor's version counter back: what autograd saved of it before the replay stays valid."""
    if t._version != version:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))


__all__ = ["BlockState", "foreign_hooks", "replay_safe"]

