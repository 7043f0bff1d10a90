"""Reading, loading and converting the parameters of a model whose parameters live off the device between uses
(Note [Parameter hooks], "Everything else"): state_dict() and load_state_dict(), tierflow.gathered(...), and
Module._apply (model.to(), .half(), .cuda(), ...).

Note [Parameter state]
~~~~~~~~~~~~~~~~~~~~~~
state_dict(). Each offloaded parameter's entry is a copy of its value on the host (a CPU tensor), made once per
state_dict() call: later steps do not change it, as they do not change what PyTorch's state_dict() returns once
it is copied off the device (the "keep the best weights" idiom, {k: v.cpu() for k, v in model.state_dict()},
copies on CUDA; here the values are on the host already, so .cpu() would not, and the host copy itself is what
the next step() overwrites). One copy per parameter: the host tier clones its host copy, the NVMe tier's read is
the copy. A tied weight (GPT-2's lm_head.weight and transformer.wte.weight) is one parameter under two keys, and
gets one copy under both, the same tensor object (PyTorch gives both keys one storage; safetensors' and
save_pretrained's de-duplication of tied weights go by storage). A call's copies are kept while it runs: its
outermost module's state_dict pre-hook starts the call, its own state_dict hook (the last, after its
children's) ends it. A parameter held on the device by gathered() is copied from the device (an edit made
inside gathered(modify=True) is in the snapshot). keep_vars=True returns the parameters themselves, as PyTorch
does (identity, requires_grad); their values are readable inside gathered(), as DeepSpeed ZeRO-3's are inside
GatheredParameters.

load_state_dict() fetches each module's parameters, lets the module load them and writes them back (one that
gathered() holds is the context's to write back or discard). With assign=True it would put the loaded tensors in
place of the parameters the schedule holds: refused by the outermost module's pre-hook, before anything loads.

gathered(). DeepSpeed's GatheredParameters, for reads outside the model's forward and backward: what it fetches,
writes back, refuses and counts is Note [Parameter uses], Gathered (tiering/param_uses.hpp). A write back marks the
CPU AdamW's masters stale, as model.load_state_dict() does (its fp32 masters are apart from the host copies: the
edit was overwritten at the next step).

Module._apply. model.to(), .half(), .float(), .bfloat16(), .double(), .type(), .cuda(), .cpu(), .to_empty() all
call Module._apply(fn), which calls each child's _apply and then fn on each of the module's own parameters. A
conversion of an offloaded parameter would read storage that has no memory and replace the tensor whose identity
the schedule holds, so every module of a wrapped model gets an instance attribute _apply (removed by unwrap)
that, at the outermost call (the user's, on the model or any submodule), first runs fn on a stand-in of each
offloaded parameter in its subtree (a FakeTensor: the same shape, strides, dtype and device, no memory): if fn
returns the stand-in itself (model.to(the same device), .float() of fp32 parameters, which HF Trainer and
accelerate call again after wrap) the call goes on with the offloaded parameters hidden from Module._apply
(their _parameters slots None for its duration, so their order is kept), and buffers and resident parameters
are converted as usual; otherwise nothing is changed and it raises ConfigError naming the call, the parameter,
the conversion and what to do (call it before tierflow.wrap, or tierflow.unwrap first).
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import Any, Iterable, Optional

import torch

from . import _C
from ._compile import outside_graphs

# The ParamState of every wrapped model with offloaded parameters, so that gathered() can find the one holding a
# parameter (a state whose ParamOffload has gone is dropped at the next wrap).
_states: list = []
# module -> its ParamState (Note [Parameter state], Module._apply); weak: a module that goes takes its entry.
_apply_guards: "weakref.WeakKeyDictionary[torch.nn.Module, ParamState]" = weakref.WeakKeyDictionary()
_applying = threading.local()  # .depth: nested Module._apply calls under the outermost checked one


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ParamState:
    """What one wrapped model's parameter state needs between calls: its ParamOffload (weak), the forward in
    progress, the parameters gathered() holds, a state_dict() call's copies."""

    def __init__(self, model: torch.nn.Module, me: Any) -> None:
        self.me = me
        self.model_type = type(model).__name__
        # By id(p): what gathered() holds, and the model's forwards in progress (Note [Parameter uses], Gathered)
        self.held = _C.ParamGathers()
        self.local = threading.local()  # .depth, .copies: the state_dict() call in progress on this thread

    def offload(self) -> Any:
        return self.me()

    def offloaded(self, p: torch.Tensor) -> bool:
        offload = self.me()
        return offload is not None and offload.impl.offloaded(p)


class _Removable:
    def __init__(self, remove: Any) -> None:
        self.remove = remove


def state_hooks(model: torch.nn.Module, me: Any) -> list:
    """The state_dict and load_state_dict hooks of every module of ``model`` holding parameters, the forward
    hooks that tell gathered() a forward is in progress, and the Module._apply guard of every module (Note
    [Parameter state]); ``me``: a weak reference to its ParamOffload. Returns handles with remove()."""
    state = ParamState(model, me)
    handles = []
    _install_step_refusal()
    _states[:] = [s for s in _states if s.offload() is not None] + [state]

    def begins(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        local = state.local
        if getattr(local, "depth", 0) == 0 or prefix == "":  # a new call (prefix "": no parent's, whatever an
            local.depth, local.copies = 0, {}                # earlier call that raised left)
        local.depth = getattr(local, "depth", 0) + 1

    def saving(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        local = state.local
        local.depth = max(getattr(local, "depth", 1) - 1, 0)
        copies = getattr(local, "copies", None)
        if copies is None:
            copies = local.copies = {}
        try:
            offload = me()
            if offload is None:
                return
            for name, p in module._parameters.items():
                key = prefix + name
                if p is None or key not in state_dict or state_dict[key] is p:  # keep_vars=True: p itself
                    continue
                if not offload.impl.offloaded(p):
                    continue
                made = copies.get(id(p))
                if made is None or made[0] is not state_dict:
                    made = copies[id(p)] = (state_dict, _snapshot(state, offload, p))
                state_dict[key] = made[1]
        finally:
            if local.depth == 0:
                local.copies = None  # the call ends: its copies are the caller's alone

    def refuse_assign(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any,
                      *args: Any) -> None:
        offload = me()
        if offload is None or not (local_metadata or {}).get("assign_to_params_buffers", False):
            return
        # The outermost module's pre-hook runs before any module loads: nothing has changed yet.
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if offload.impl.offloaded(p):
                raise _C.ConfigError(_C._assign_refusal(name, offload.tier))

    def loading(module: torch.nn.Module, *args: Any) -> None:
        offload = me()
        if offload is not None:
            for p in module.parameters(recurse=False):
                if not state.held.held(id(p)):
                    offload.impl.materialize(p, True)

    def loaded(module: torch.nn.Module, incompatible: Any) -> None:
        offload = me()
        if offload is not None:
            for p in module.parameters(recurse=False):
                if not state.held.held(id(p)):
                    offload.impl.materialize(p, False)

    for module in model.modules():
        handles.append(module.register_load_state_dict_pre_hook(refuse_assign))
        handles.append(module.register_state_dict_pre_hook(begins))
        handles.append(module._register_state_dict_hook(saving))
        if any(True for _ in module.parameters(recurse=False)):
            handles.append(module.register_load_state_dict_pre_hook(loading))
            handles.append(module.register_load_state_dict_post_hook(loaded))

    def forward_begins(m: torch.nn.Module, args: Any) -> None:
        if not _in_backward():  # (refuses one that builds a graph inside gathered())
            state.held.forward_begins(torch.is_grad_enabled(), state.model_type)

    def forward_ends(m: torch.nn.Module, args: Any, out: Any) -> None:
        if not _in_backward():
            state.held.forward_ends()

    handles.append(model.register_forward_pre_hook(outside_graphs(forward_begins), prepend=True))
    handles.append(model.register_forward_hook(outside_graphs(forward_ends), always_call=True))
    handles.append(_guard_apply(model, state))
    return handles


_step_refusal_installed = False


def _install_step_refusal() -> None:
    """An optimizer step over parameters gathered() holds is refused (torch's global step pre-hook, once)."""
    global _step_refusal_installed
    if not _step_refusal_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_refuse_step_inside_gathered)
        _step_refusal_installed = True


def _refuse_step_inside_gathered(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    held = [s.held for s in _states if s.held.any()]
    if not held:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if any(h.held(id(p)) for h in held):
                raise _C.ConfigError(_C._gathered_step_refusal(type(optimizer).__name__))


def _snapshot(state: ParamState, offload: Any, p: torch.Tensor) -> torch.Tensor:
    """p's value now, in a host tensor of its own: the device's copy while gathered() holds it, else its host
    copy's clone or a fresh read from NVMe (ParamResidency::load: the host copy itself, or a new tensor)."""
    if state.held.held(id(p)):
        return p.detach().to("cpu", copy=True)
    value = offload.impl.load(p)
    return value.clone() if offload.impl.host_copy(p) is not None else value


# -- gathered() --------------------------------------------------------------------------------------------------

def _parameters_of(what: Any) -> list:
    if isinstance(what, torch.nn.Module):
        return list(what.parameters())
    if isinstance(what, torch.Tensor):
        return [what]
    if isinstance(what, Iterable) and not isinstance(what, (str, bytes)):
        out = []
        for item in what:
            out += _parameters_of(item)
        return out
    raise TypeError(f"tierflow.gathered: takes a module, a parameter, or an iterable of them; got "
                    f"{type(what).__name__}")


class gathered:
    """``with tierflow.gathered(model_or_modules_or_params, modify=False):`` the given parameters that live off
    the device between uses (TIERFLOW_OFFLOAD_PARAMS) are on the device inside the block; on exit, written back
    when ``modify`` (else an in-place write raises) and released. Others pass through. Outside the model's
    forward and backward only (Note [Parameter state], gathered())."""

    def __init__(self, params: Any, modify: bool = False) -> None:
        self._params = _parameters_of(params)
        self._modify = bool(modify)
        self._mine: list = []  # [(state, [params this context fetched or joined])]

    def __enter__(self) -> "gathered":
        seen: set = set()
        params = [p for p in self._params if not (id(p) in seen or seen.add(id(p)))]
        try:
            for state in list(_states):
                offload = state.offload()
                if offload is None:
                    continue
                mine = [p for p in params if offload.impl.offloaded(p)]
                if not mine:
                    continue
                state.held.check_outside_passes(_in_backward(), state.model_type)  # (inside the model's passes)
                ids = [id(p) for p in mine]
                fresh = set(state.held.fresh(ids))
                _gather(offload, [p for p in mine if id(p) in fresh])
                state.held.enter(ids, self._modify, [p._version for p in mine])
                self._mine.append((state, mine))
        except BaseException:
            self._release(raising=True)
            raise
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        self._release(raising=kind is not None)

    def _release(self, raising: bool) -> None:
        written = []
        error: Optional[BaseException] = None
        mine, self._mine = self._mine, []
        for state, params in mine:
            offload = state.offload()
            by_id = {id(p): p for p in params}
            back, keep, edited = state.held.exit(list(by_id), [p._version for p in by_id.values()])
            if offload is None:
                continue
            back, keep = [by_id[i] for i in back], [by_id[i] for i in keep]
            written += [_name(offload, by_id[i]) for i in edited]
            # Each on its own, the first error going on: a write back that fails (ParamMover's scatter releases
            # every hold all the same and keeps the values it could not write in host memory, Note [Parameter
            # moves]) neither keeps the unedited ones held nor skips the masters' re-read of the edits.
            try:
                _scatter(offload, back, True)
            except BaseException as e:
                error = error or _discard_unwritable(offload, back, e)
            finally:
                if back:
                    _masters_stale(offload)
            try:
                _scatter(offload, keep, False)
            except BaseException as e:
                error = error or e
        if error is not None and not raising:
            raise error
        if written and not raising:
            raise _C.TierflowError(_C._gathered_edited_error(written))


def _discard_unwritable(offload: Any, params: list, error: BaseException) -> BaseException:
    """A write back that could not be made at all (no pinned room to stage it, a failed copy from the device):
    ParamMover's scatter then keeps every hold, which no later exit would undo, so the parameters would stay on the
    device for good, each use reading them there while a step writes their host copies. They are released without
    it here, their edits discarded; the error says so. (A failed NVMe write keeps the values and releases them.)"""
    held = [p for p in params if offload.impl.on_device(p)]
    if not held:
        return error
    try:
        offload.impl.scatter(held, False)
    except BaseException:  # noqa: BLE001  (a stall): the first error goes on
        return error
    names = ", ".join(repr(_name(offload, p)) for p in held[:3]) + (" and others" if len(held) > 3 else "")
    try:
        return type(error)(f"{error}; tierflow.gathered: the values written inside the block to {names} could not be "
                           "written back and are discarded: these parameters keep their values from before the block")
    except Exception:  # noqa: BLE001  an error type that takes no message
        return error


def _masters_stale(offload: Any) -> None:
    """tierflow's CPUAdamW stepping these parameters keeps fp32 masters apart from the host copies: written
    back, they are re-read from the parameters at its next step (as after model.load_state_dict)."""
    ref = getattr(offload, "_optimizer", None)
    optimizer = ref() if ref is not None else None
    if optimizer is not None:
        optimizer.mark_master_stale()


def _name(offload: Any, p: torch.Tensor) -> str:
    model = offload._model()
    if model is not None:
        for name, q in model.named_parameters(remove_duplicate=False):
            if q is p:
                return name
    return "?"


def _gather(offload: Any, params: list) -> None:
    """Fetches ``params`` to the device and waits: ParamResidency::gather (all or none, counted in the budget; over
    it, out_of_memory says to gather fewer)."""
    if params:
        offload.impl.gather(params)


def _scatter(offload: Any, params: list, write_back: bool) -> None:
    """Writes ``params`` back to their host copy or NVMe (``write_back``) and releases them."""
    if params:
        offload.impl.scatter(params, write_back)


# -- Module._apply: model.to(), .half(), .cuda(), ... after wrap ------------------------------------------------

def _guard_apply(model: torch.nn.Module, state: ParamState) -> _Removable:
    """Every module of ``model`` gets the _apply of Note [Parameter state]; the handle takes them away."""
    guarded = []
    for module in model.modules():
        if "_apply" in module.__dict__:
            continue  # a module of two wrapped models' (or its own _apply): leave it
        module.__dict__["_apply"] = types.MethodType(_guarded_apply, module)
        _apply_guards[module] = state
        guarded.append(weakref.ref(module))

    def remove() -> None:
        for ref in guarded:
            module = ref()
            if module is None:
                continue
            bound = module.__dict__.get("_apply")
            if isinstance(bound, types.MethodType) and bound.__func__ is _guarded_apply:
                del module.__dict__["_apply"]
            if _apply_guards.get(module) is state:
                del _apply_guards[module]
        guarded.clear()

    return _Removable(remove)


def _guarded_apply(module: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    state = _apply_guards.get(module)
    original = type(module)._apply
    if state is None or state.offload() is None:  # unwrapped, or a deep copy of a wrapped module
        return original(module, fn, recurse)
    depth = getattr(_applying, "depth", 0)
    if depth == 0:
        _refuse_conversion(module, fn, recurse, state, sys._getframe(1).f_code.co_name)
    hidden = {k: p for k, p in module._parameters.items() if p is not None and state.offloaded(p)}
    _applying.depth = depth + 1
    try:
        for k in hidden:
            module._parameters[k] = None  # Module._apply skips it; the slot keeps its place in the order
        return original(module, fn, recurse)
    finally:
        for k, p in hidden.items():
            module._parameters[k] = p
        _applying.depth = depth


def _refuse_conversion(module: torch.nn.Module, fn: Any, recurse: bool, state: ParamState, call: str) -> None:
    """Raises ConfigError, changing nothing, where ``fn`` would convert an offloaded parameter of ``module``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    offload = state.offload()
    seen: set = set()
    tried: dict = {}  # (shape, strides, dtype, device) -> None (fn returns the stand-in) or what it makes
    for name, p in module.named_parameters(recurse=recurse, remove_duplicate=False):
        if id(p) in seen or not offload.impl.offloaded(p):
            continue
        seen.add(id(p))
        key = (tuple(p.shape), p.stride(), p.dtype, p.device)
        if key not in tried:
            with FakeTensorMode():
                stand_in = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
                try:
                    with torch.no_grad():
                        out = fn(stand_in)
                    tried[key] = None if out is stand_in else f"{out.dtype} on {out.device}"
                except Exception as e:  # what the call would do to it fails anyway
                    tried[key] = f"something it cannot be ({type(e).__name__}: {e})"
        if tried[key] is not None:
            raise _C.ConfigError(_C._conversion_refusal(type(module).__name__, call, name, f"{p.dtype} on {p.device}",
                                                        tried[key], offload.tier))
