"""``tierflow.wrap``: attach a runtime to an unchanged model and optimizer."""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch
from torch.utils._pytree import tree_flatten

from . import _C
from ._config import settings_to_strings
from ._report import Report

_sessions: "list[Session]" = []


class Session:
    """One runtime and the hooks that connect it to one model."""

    def __init__(self, _nvme_faults: Any = None, _copy_faults: Any = None, **settings: Any) -> None:
        # _nvme_faults, _copy_faults: a tierflow._C.NvmeFaults or CopyFaults, for fault-injection tests only.
        self._faults = (_nvme_faults, _copy_faults)  # the runtime holds raw pointers to them
        self.runtime = _C.Runtime(settings_to_strings(settings), _nvme_faults, _copy_faults)
        self.config = self.runtime.config()
        self._handles: list[Any] = []
        self._contexts: list[Optional[Any]] = []
        self._model_ref: Optional[weakref.ref] = None
        self.optimizer: Optional[weakref.ref] = None  # the CPUAdamW of this session, if any
        self.planner: Optional[Any] = None  # auto / recompute: the per-block plans (Note [Activation plans])

    # -- model hooks -----------------------------------------------------------
    def attach(self, model: torch.nn.Module, blocks: Optional[list] = None) -> None:
        """Installs the saved-tensor hooks around every forward of ``model``; with
        TIERFLOW_OFFLOAD_ACTIVATIONS=auto or recompute, the per-block plans on
        ``blocks`` (default: the repeated blocks found in the model)."""
        self._model_ref = weakref.ref(model)
        if self.config["TIERFLOW_OFFLOAD_ACTIVATIONS"] in ("auto", "recompute"):
            from ._autoplan import AutoPlanner

            self.planner = AutoPlanner(self, model, blocks)
        self.runtime.register_parameters([p for p in model.parameters()])
        self._handles.append(model.register_forward_pre_hook(self._before_forward))
        self._handles.append(model.register_forward_hook(self._after_forward, always_call=True))

    def detach(self) -> None:
        """Removes the hooks; saved tensors already offloaded still come back."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.planner is not None:
            self.planner.remove()

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        opt = self.optimizer() if self.optimizer is not None else None
        if opt is not None and opt.has_unconfirmed_steps():
            # A forward before step(): the early steps were not the last backward's.
            opt.take_back_unconfirmed()
        if not torch.is_grad_enabled() or any(c is not None for c in self._contexts):
            self._contexts.append(None)  # nothing saved (no_grad), or a nested call
            return
        self.runtime.register_parameters([p for p in module.parameters()])
        if self.planner is not None:
            self.planner.before_forward()
            if self.planner.keep_all:  # the plan keeps everything: no hooks, no cost
                self._contexts.append(None)
                return
        self.runtime.begin_forward()
        ctx = torch.autograd.graph.saved_tensors_hooks(self.runtime.pack, self.runtime.unpack)
        ctx.__enter__()
        self._contexts.append(ctx)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._contexts:
            return
        ctx = self._contexts.pop()
        if ctx is None:
            return
        ctx.__exit__(None, None, None)
        # Backward reaches the model's outputs first: that is when prefetch starts.
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        self.runtime.begin_backward()

    # -- reporting -------------------------------------------------------------
    def report(self) -> Report:
        """Current statistics; also written to TIERFLOW_REPORT when set."""
        r = Report(self.runtime.stats())
        r["config"] = dict(self.config)
        opt = self.optimizer() if self.optimizer is not None else None
        r["optimizer"]["overlap"] = dict(getattr(opt, "overlap_stats", {}) or {})
        if self.planner is not None:
            r["plan"] = self.planner.report()
        streaming = opt.stream_stats() if hasattr(opt, "stream_stats") else {}
        if streaming:
            r["optimizer"]["streaming"] = streaming
        path = self.config.get("TIERFLOW_REPORT", "")
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
    (lower-case names of the TIERFLOW_* variables) and override the environment. Create LR
    schedulers after wrapping, on the returned optimizer.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tierflow.wrap: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_tierflow_session", None) is not None:
        raise _C.TierflowError("tierflow.wrap: this model is already wrapped; call tierflow.unwrap(model) first")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"tierflow.wrap: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    session = Session(**settings)
    new_optimizer = optimizer
    try:
        if optimizer is not None and session.config["TIERFLOW_OFFLOAD_OPTIMIZER"] in ("host", "nvme"):
            from .optim import CPUAdamW

            # Checks at construction what its states need (host budget, NVMe space: issue 16).
            new_optimizer = CPUAdamW.replace(optimizer, session.runtime, model=model)
            session.optimizer = weakref.ref(new_optimizer)
        session.attach(model, blocks)
        if session.config["TIERFLOW_OFFLOAD_ACTIVATIONS"] != "none":  # Note [HF caches]
            from ._hf import disable_cache_in_training

            session._handles += disable_cache_in_training(model)
    except BaseException:
        # A failed wrap leaves nothing: no hooks, and no swap file (the traceback may keep the runtime).
        session.detach()
        session.runtime.unlink_nvme_files()
        raise
    model._tierflow_session = session
    _sessions.append(session)
    return model, new_optimizer


def unwrap(model: torch.nn.Module) -> None:
    """Removes tierflow's hooks from a wrapped model."""
    session = getattr(model, "_tierflow_session", None)
    if session is None:
        raise _C.TierflowError("tierflow.unwrap: this model was not wrapped by tierflow.wrap")
    session.detach()
    model._tierflow_session = None


def current_session() -> Optional[Session]:
    """The most recently created session, or None."""
    return _sessions[-1] if _sessions else None


def report() -> Report:
    """Statistics of the most recent ``wrap``; print it for a table."""
    session = current_session()
    if session is None:
        raise _C.TierflowError("tierflow.report: nothing is wrapped yet; call tierflow.wrap(model, optimizer) first")
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
    for session in _sessions:
        if session.config.get("TIERFLOW_REPORT"):
            try:
                session.report()
            except Exception:  # noqa: BLE001  the interpreter is exiting; never mask its status
                pass
    # Drop the runtimes now, while the interpreter still runs, so that their
    # NVMe swap files are removed (saved tensors still alive keep theirs until
    # they go, and the next start removes anything a crash left behind).
    for session in _sessions:
        session.detach()
        session.runtime.unlink_nvme_files()
    _sessions.clear()
