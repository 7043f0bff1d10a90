"""``tierflow.wrap``: attach a runtime to an unchanged model and optimizer."""

from __future__ import annotations

import atexit
import contextlib
import functools
import sys
import weakref
from typing import Any, Iterator, Optional

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from . import _C, _param_casts
from ._compile import outside_graphs
from ._config import settings_to_strings
from ._distributed import check_forward, check_wrap, fsdp_modules, rank_and_world_size, refuse_sharded
from ._report import Report
from ._step_stats import StepStatsHooks

# Note [Session lifetime]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A session (its runtime: pinned slabs, swap files, worker threads) lives as long
# as the model it is attached to (model._tierflow_session) or the CPUAdamW that
# steps on its runtime: the package keeps only weak references, for report(),
# current_session() and the final reports at exit. So wrap / train / unwrap / del
# in a loop holds one runtime at a time, and a model that goes takes its swap
# files with it (once the garbage collector has broken the model's reference
# cycles: the hooks and the block runners refer back to it). unwrap() detaches
# the hooks and drops the model's reference at once.
_sessions: "list[weakref.ref[Session]]" = []


def _live_sessions() -> "list[Session]":
    """The sessions still alive, oldest first (Note [Session lifetime])."""
    alive = [(r, r()) for r in _sessions]
    _sessions[:] = [r for r, s in alive if s is not None]
    return [s for _, s in alive if s is not None]



def input_elements(args: Any, kwargs: Any) -> dict:
    """The elements of each tensor the model is called with, nested ones included, by its place among the
    arguments: what a forward's size is measured on (Note [Batch growth]; tiering::batch_size)."""
    return {keystr(path): t.numel() for path, t in tree_flatten_with_path((args, kwargs))[0]
            if isinstance(t, torch.Tensor)}


def _alias(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # Note [Saved-tensor hook aliases] in activations/runner.py


_kept = (_alias, lambda t: t)  # saved tensors stay where they are


class _CastsOnly(torch.autograd.graph.saved_tensors_hooks):
    """A forward whose plan keeps everything: only casts of offloaded parameters are saved as recipes (Note
    [Parameter casts])."""

    def __init__(self) -> None:
        super().__init__(*_param_casts.around(*_kept))
        self.__enter__()


def _refuse_deepcopy(memo: Any = None) -> None:
    """copy.deepcopy(model) of a wrapped model (TRL's reference model, an EMA copy): the copy's hooks would drive
    this session's runtime, and its parameters may live off the device. Set on the model (and the session) by wrap."""
    raise _C.ConfigError(_C.deepcopy_refusal())


class Session:
    """One runtime and the hooks that connect it to one model."""

    def __deepcopy__(self, memo: dict) -> None:
        _refuse_deepcopy(memo)

    def __init__(self, _nvme_faults: Any = None, _copy_faults: Any = None, **settings: Any) -> None:
        # _nvme_faults, _copy_faults: a tierflow._C.NvmeFaults or CopyFaults, for fault-injection tests only.
        self._faults = (_nvme_faults, _copy_faults)  # the runtime holds raw pointers to them
        rank, world_size = rank_and_world_size()  # Note [Ranks on one machine]
        self.runtime = _C.Runtime(settings_to_strings(settings), _nvme_faults, _copy_faults, rank, world_size)
        self.config = self.runtime.config()  # every setting as text, for reports (and code that still reads text)
        self.settings = self.runtime.settings()  # the same, typed: read these (Note [Typed settings])
        self._handles: list[Any] = []
        self._contexts: list[Optional[Any]] = []
        self._model_ref: Optional[weakref.ref] = None
        self.optimizer: Optional[weakref.ref] = None  # the CPUAdamW of this session, if any
        self.planner: Optional[Any] = None  # auto / recompute: the per-block plans (Note [Activation plans])
        self.distributed: Optional[Any] = None  # what the forwards still check (Note [Distributed training])
        self.params: Optional[Any] = None  # TIERFLOW_OFFLOAD_PARAMS: the ParamOffload (Note [Parameter hooks])
        self.step_stats = StepStatsHooks(self.runtime)  # tierflow.step_stats() (Note [Step stats])
        self._forward_marked = False  # the outermost training forward is marked on step_stats

    # -- model hooks -----------------------------------------------------------
    def attach(self, model: torch.nn.Module, blocks: Optional[list] = None) -> None:
        """Installs the saved-tensor hooks around every forward of ``model``; with
        TIERFLOW_OFFLOAD_ACTIVATIONS=auto or recompute, the per-block plans on
        ``blocks`` (default: the repeated blocks found in the model)."""
        self._model_ref = weakref.ref(model)
        if self.settings.offload_activations in ("auto", "recompute"):
            from .activations.autoplan import AutoPlanner

            self.planner = AutoPlanner(self, model, blocks)
        self.runtime.register_parameters([p for p in model.parameters()])
        self.watch_fsdp(fsdp_modules(model))
        # Note [Hooks outside graphs]: dynamo never traces them.
        self._handles.append(model.register_forward_pre_hook(outside_graphs(self._before_forward), with_kwargs=True))
        self._handles.append(model.register_forward_hook(outside_graphs(self._after_forward), always_call=True))
        if self.settings.offload_params != "none":  # after the plans' hooks: Note [Parameter hooks]
            from .params import ParamOffload

            self.params = ParamOffload(self, model, blocks)
            _param_casts.watch(self.params)

    def watch_fsdp(self, modules: list) -> None:
        """FSDP2 modules (Note [Distributed training]): before each one's forward, after FSDP2's own pre-forward
        hook has gathered its parameters, the offloader learns the unsharded parameters' storages, so that a
        saved tensor that is (a view of) one stays where FSDP2 manages it and is never copied as an activation
        (FSDP2 frees that storage after the forward and gathers it again for backward)."""
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(outside_graphs(self._register_unsharded)))

    def _register_unsharded(self, module: torch.nn.Module, args: Any) -> None:
        dtensor = sys.modules.get("torch.distributed.tensor")
        sharded = getattr(dtensor, "DTensor", ()) if dtensor is not None else ()
        self.runtime.register_parameters([p for p in module.parameters() if not isinstance(p, sharded)])

    def detach(self) -> None:
        """Removes the hooks; saved tensors already offloaded still come back."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        opt = self.optimizer() if self.optimizer is not None else None
        if opt is not None and hasattr(opt, "detach_model"):
            opt.detach_model()
        if self.planner is not None:
            self.planner.remove()
        if self.params is not None:
            self.params.remove()  # the parameters get their device memory back
            self.params = None

    def _before_forward(self, module: torch.nn.Module, args: Any, kwargs: Any = None) -> None:
        opt = self.optimizer() if self.optimizer is not None else None
        if self.distributed is not None and self.distributed.pending:  # FSDP2 after wrap found, DDP noted:
            check_forward(self.distributed, opt, module, self.settings)  # Note [Distributed training]
            if self.distributed.fsdp_found:  # fully_shard after wrap: its modules' parameters from now on
                self.watch_fsdp(self.distributed.fsdp_found)  # (the root's: registered below, as always)
                self.distributed.fsdp_found = []
        if opt is not None and opt.has_unconfirmed_steps():
            # A forward before step(): the early steps were not the last backward's.
            opt.take_back_unconfirmed()
        if not torch.is_grad_enabled() or any(c is not None for c in self._contexts):
            self._contexts.append(None)  # nothing saved (no_grad), or a nested call
            return
        if not self._contexts:  # Note [Step stats]: the outermost training forward
            self._forward_marked = True
            self.step_stats.forward_begin()
        self.runtime.register_parameters([p for p in module.parameters()])
        if self.planner is not None:
            self.planner.before_forward(input_elements(args, kwargs))
            if self.planner.keep_all:  # the plan keeps everything: no hooks, no cost
                # (but casts of offloaded parameters: Note [Parameter casts])
                _C.trace_sample()  # its bytes per tier in the trace all the same (Note [Trace])
                self._contexts.append(_CastsOnly() if self.params is not None else None)
                return
        self.runtime.begin_forward()
        _C.trace_sample()  # bytes per tier in the trace (Note [Trace]), also where no block spans are recorded
        hooks: Any = (self.runtime.pack, self.runtime.unpack)
        if self.planner is not None and self.planner.outside_kept:
            # The blocks' runners swap theirs; what is saved outside them stays (Note [Activation planner]).
            hooks = None
        elif self.planner is not None and self.planner.outside_tier == "nvme":
            # The plan puts them on NVMe: the policy's decision and count (policy_bytes), NVMe's tier.
            runtime = self.runtime
            hooks = (lambda t: runtime.pack_to(t, "outside_nvme"), runtime.unpack)
        if self.params is not None:  # Note [Parameter casts]: casts of offloaded parameters are made again
            hooks = _param_casts.around(*(hooks or _kept))
        ctx = torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext()
        ctx.__enter__()
        self._contexts.append(ctx)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._contexts:
            return
        ctx = self._contexts.pop()
        if self._forward_marked and not self._contexts:  # Note [Step stats]
            self._forward_marked = False
            self.step_stats.forward_end(output)
        if ctx is None:
            return
        ctx.__exit__(None, None, None)
        if isinstance(ctx, _CastsOnly):
            return
        # Backward reaches the model's outputs first: that is when prefetch starts.
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        self.runtime.begin_backward()
        _C.trace_sample()


    # -- reporting -------------------------------------------------------------
    def report(self) -> Report:
        """Current statistics; also written to TIERFLOW_REPORT when set."""
        r = Report(self.runtime.stats())
        r["config"] = dict(self.config)
        opt = self.optimizer() if self.optimizer is not None else None
        r["optimizer"]["overlap"] = dict(getattr(opt, "overlap_stats", {}) or {})
        off = getattr(opt, "_steps_after_backward", None)
        if off:  # why every parameter steps in step() (DDP's hook before tierflow's, FSDP2's shards, ...)
            r["optimizer"]["steps_during_backward_off"] = off
        if hasattr(opt, "state_stats"):  # Note [Optimizer state formats]: what the states hold, in which format
            r["optimizer"]["states"] = opt.state_stats()
        partition = opt.partition_stats() if hasattr(opt, "partition_stats") else None
        if partition:  # Note [Partitioned optimizer]: this rank's share
            r["optimizer"]["partition"] = partition
        if self.planner is not None:
            r["plan"] = self.planner.report()
        if self.params is not None:
            r["params"] = self.params.stats()
            r["params"]["casts"] = _param_casts.stats(self.params)  # Note [Parameter casts]
        streaming = opt.stream_stats() if hasattr(opt, "stream_stats") else {}
        if streaming:
            r["optimizer"]["streaming"] = streaming
        counters = _C.step_counters(self.runtime)  # Note [Step stats]: the NVMe links' totals, the steps recorded
        r["links"]["host_to_nvme_bytes"] = counters["host_to_nvme_bytes"]
        r["links"]["nvme_to_host_bytes"] = counters["nvme_to_host_bytes"]
        r["steps"] = {"recorded": self.step_stats.recorder.recorded, "last": self.step_stats.last()}
        path = self.settings.report
        if path:
            r.save(path)
        return r


def wrap(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         blocks: Optional[list] = None, **settings: Any) -> "tuple[torch.nn.Module, Optional[torch.optim.Optimizer]]":
    """Attaches tierflow to ``model`` and replaces ``optimizer`` by a CPU AdamW.

    Returns the same module object (its state_dict, parameters and hooks keep
    working) and the optimizer to use from now on: a ``tierflow.CPUAdamW``
    with the replaced optimizer's param_groups, hyperparameters and state when
    TIERFLOW_OFFLOAD_OPTIMIZER is ``host`` (the default), the same optimizer
    when it is ``none``. ``blocks``: the model's repeated blocks that the
    activation plans of TIERFLOW_OFFLOAD_ACTIVATIONS=auto / recompute apply to
    (default: found, Note [Activation plans]). Keyword arguments are settings
    (lower-case names of the TIERFLOW_* variables) and override the environment. An LR scheduler
    made before or after wrapping works (Note [Shared param groups] in optim.py). ``optimizer`` may
    be a wrapper exposing ``.optimizer`` (accelerate's AcceleratedOptimizer): Note [Optimizer wrappers].
    An optimizer holding parameters that are not ``model``'s is refused.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tierflow.wrap: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_tierflow_session", None) is not None:
        raise _C.TierflowError("tierflow.wrap: this model is already wrapped; call tierflow.unwrap(model) first")
    chain = _optimizer_chain(optimizer) if optimizer is not None else []
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    wrong_device = one_cuda_device(devices, torch.cuda.current_device() if any(d.type == "cuda" for d in devices)
                                   else 0)
    if wrong_device:
        raise _C.TierflowError(wrong_device)
    _refuse_meta(model)
    session = Session(**settings)
    new_optimizer = optimizer
    try:
        # A setting the chosen mode would ignore (Note [Settings a mode ignores] in core/config.hpp).
        refusal, warnings = _C.ignored_settings(session.settings, any(d.type == "cuda" for d in devices))
        if refusal is not None:
            raise _C.ConfigError(f"tierflow.wrap: {refusal}")
        _refuse_device_budget(model, session)
        for line in warnings:
            _C.log("warn", f"tierflow.wrap: {line}")
        # FSDP2 with settings it cannot train, tensor parallelism: refused before anything is attached.
        refuse_sharded(model, chain[-1] if chain else None, session.settings)
        replacing = optimizer is not None and session.settings.offload_optimizer in ("host", "nvme")
        if replacing:
            from .optim import CPUAdamW

            CPUAdamW.check_replaceable(chain[-1])
        if chain:
            _check_parameters_are_the_models(model, chain[-1])
        if replacing:
            inner = chain[-1]
            for wrapper in chain[:-1]:
                _check_wrapper_can_be_repointed(wrapper, inner)
            # Checks at construction what its states need (host budget, NVMe space: issue 16).
            replacement = CPUAdamW.replace(inner, session.runtime, model=model)
            if len(chain) > 1:  # Note [Optimizer wrappers]: the wrapper now wraps the CPUAdamW
                chain[-2].optimizer = replacement
            else:
                new_optimizer = replacement
            session.optimizer = weakref.ref(replacement)
        # DDP: steps during backward off, before any backward (Note [Distributed training]).
        session.distributed = check_wrap(session.optimizer() if session.optimizer is not None else None, model)
        session.attach(model, blocks)
        watched = session.optimizer() if session.optimizer is not None else (chain[-1] if chain else None)
        session._handles += session.step_stats.watch_optimizer(watched)  # Note [Step stats]: step() ends a step
        if session.planner is not None and session.optimizer is not None:  # Note [Steady step]: the GPU share
            session.optimizer().follow_activation_plan(session.planner)  # waits for the plan in force
        if session.params is not None:  # Note [Parameter hooks]: which optimizer steps the host copies
            session.params.adopt_optimizer(session.optimizer() if session.optimizer is not None else None)
        if session.settings.offload_activations != "none":  # Note [HF caches]
            from ._hf import disable_cache_in_training

            session._handles += disable_cache_in_training(model)
    except BaseException:
        # A failed wrap leaves nothing: no hooks, and no swap file (the traceback may keep the runtime).
        if len(chain) > 1:
            chain[-2].optimizer = chain[-1]
        session.detach()
        session.runtime.unlink_nvme_files()
        raise
    model._tierflow_session = session
    model.__deepcopy__ = _refuse_deepcopy  # copy.deepcopy looks it up on the instance first
    _sessions.append(weakref.ref(session))
    return model, new_optimizer


# Note [Optimizer wrappers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Training tools wrap the optimizer in an object that exposes the wrapped one as
# ``.optimizer`` and delegates step, zero_grad, param_groups and state_dict to it
# (accelerate's AcceleratedOptimizer after accelerator.prepare). wrap() follows
# ``.optimizer`` to the torch optimizer, replaces that by the CPUAdamW and points
# the innermost wrapper's ``.optimizer`` at it, and returns the outermost wrapper
# unchanged, so the tool's own bookkeeping (its checkpoints, its scheduler, its
# gradient-accumulation skipping) goes on through the CPUAdamW. That is right
# only when the wrapper reaches the optimizer through ``.optimizer`` alone: a
# wrapper that kept another reference (AcceleratedOptimizer with a GradScaler
# keeps the optimizer's bound ``step``) would go on stepping the replaced
# optimizer on the device, so wrap() refuses it, saying to call tierflow.wrap
# first and wrap its result. With offload_optimizer=none nothing is replaced and
# the wrapper is returned as it is.


def one_cuda_device(devices: "set[torch.device]", current: int) -> Optional[str]:
    """Why a model on ``devices`` cannot be wrapped while CUDA device ``current`` is current, or None
    (tiering::one_cuda_device decides and words it)."""
    return _C.one_cuda_device([current if d.index is None else d.index for d in devices if d.type == "cuda"],
                              current) or None


def _refuse_meta(model: torch.nn.Module) -> None:
    """A model on the meta device has shapes and no values: training it would fail in step(), after wrap took it."""
    meta = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if meta:  # Note [Wrap refusals] in tiering/wrap_checks.hpp
        raise _C.TierflowError(f"tierflow.wrap: {_C.meta_refusal(len(meta), repr(meta[0][0]), list(meta[0][1].shape))}")


def _refuse_device_budget(model: torch.nn.Module, session: Session) -> None:
    """The parameters on the device and their gradients above TIERFLOW_GPU_MEMORY: refused at wrap, where the shapes
    are known (Note [Wrap refusals] in tiering/wrap_checks.hpp decides and words it)."""
    if session.settings.offload_params != "none":
        return
    runtime = session.runtime
    params = [p for p in {id(p): p for p in model.parameters()}.values() if runtime.on_device(p)]
    why = _C.device_budget_refusal(session.settings, runtime.device_budget_bytes(),
                                   sum(p.numel() * p.element_size() for p in params),
                                   sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    if why:
        raise _C.ConfigError(f"tierflow.wrap: {why}")


def _optimizer_chain(optimizer: Any) -> list:
    """[optimizer, what it wraps, ..., the torch optimizer]: Note [Optimizer wrappers]."""
    chain = [optimizer]
    while (not isinstance(chain[-1], (torch.optim.AdamW, torch.optim.Adam))
           and getattr(chain[-1], "optimizer", None) is not None and len(chain) < 16):
        inner = getattr(chain[-1], "optimizer")
        if not isinstance(inner, torch.optim.Optimizer) and getattr(inner, "optimizer", None) is None:
            break
        chain.append(inner)
    if not isinstance(chain[-1], torch.optim.Optimizer):
        raise TypeError(f"tierflow.wrap: optimizer must be a torch.optim.Optimizer (or a wrapper whose .optimizer "
                        f"is one), got {type(optimizer).__name__}")
    return chain


def _refers_to(value: Any, target: Any, depth: int = 2) -> bool:
    """True when ``value`` is ``target``, a method bound to it, a weak reference to it, or a function whose
    closure (or functools.partial arguments, or __wrapped__) holds one, to ``depth`` levels."""
    if value is target:
        return True
    if isinstance(value, weakref.ref):
        return value() is target
    if getattr(value, "__self__", None) is target:
        return True
    if depth == 0:
        return False
    inner: list = []
    for cell in getattr(value, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    if isinstance(value, functools.partial):
        inner += [value.func, *value.args, *value.keywords.values()]
    if hasattr(value, "__wrapped__"):
        inner.append(value.__wrapped__)
    return any(_refers_to(v, target, depth - 1) for v in inner)


def _check_wrapper_can_be_repointed(wrapper: Any, inner: torch.optim.Optimizer) -> None:
    """Refuses a wrapper that holds the optimizer elsewhere than in ``.optimizer`` (Note [Optimizer wrappers])."""
    for name, value in vars(wrapper).items():
        if name != "optimizer" and _refers_to(value, inner):
            raise _C.TierflowError("tierflow.wrap: " + _C.wrapper_refusal(
                f"{type(wrapper).__module__}.{type(wrapper).__qualname__}", type(inner).__name__, repr(name)))


def _check_parameters_are_the_models(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer holding parameters that are not ``model``'s; a subset of them is fine."""
    mine = {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in held if id(p) not in mine]
    if foreign:  # Note [Wrap refusals]
        raise _C.TierflowError(
            f"tierflow.wrap: {_C.foreign_parameters_refusal(len(foreign), len(held), list(foreign[0].shape))}")


def unwrap(model: torch.nn.Module) -> None:
    """Removes tierflow's hooks from a wrapped model; its runtime goes once nothing else uses it (the CPUAdamW
    wrap returned steps on it while it lives: Note [Session lifetime])."""
    session = getattr(model, "_tierflow_session", None)
    if session is None:
        raise _C.TierflowError("tierflow.unwrap: this model was not wrapped by tierflow.wrap")
    session.detach()
    model._tierflow_session = None
    model.__dict__.pop("__deepcopy__", None)
    _sessions[:] = [r for r in _sessions if r() is not session and r() is not None]


def current_session() -> Optional[Session]:
    """The most recently created session still alive, or None (Note [Session lifetime])."""
    live = _live_sessions()
    return live[-1] if live else None


def report() -> Report:
    """Statistics of the most recent ``wrap``; print it for a table."""
    session = current_session()
    if session is None:
        raise _C.TierflowError("tierflow.report: no wrapped model is alive (none was wrapped, or it was unwrapped or "
                               "deleted); call tierflow.wrap(model, optimizer) first")
    return session.report()


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Tensors saved inside this block stay on the device (this thread only)."""
    _C.push_no_offload()
    try:
        yield
    finally:
        _C.pop_no_offload()


@atexit.register
def _write_final_reports() -> None:
    live = _live_sessions()
    for session in live:
        if session.settings.report:
            try:
                session.report()
            except Exception:  # noqa: BLE001  the interpreter is exiting; never mask its status
                pass
    # Drop the runtimes now, while the interpreter still runs, so that their
    # NVMe swap files are removed (saved tensors still alive keep theirs until
    # they go, and the next start removes anything a crash left behind).
    for session in live:
        session.detach()
        session.runtime.unlink_nvme_files()
    _sessions.clear()
