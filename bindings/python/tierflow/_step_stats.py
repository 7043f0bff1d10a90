"""``tierflow.step_stats()``: per-step figures a logger takes (Note [Step stats] in tiering/step_stats.hpp).

The session's hooks mark each boundary of a training step (forward begin and end, backward begin and end,
the optimizer's step() begin and end) on a ``_C.StepRecorder``, which reads the runtime's counters in C++ and
does the arithmetic there (torch-free), the trace's steps lane included; this module only says when. Each mark
costs one call into C++ (a few atomic loads and two short locks); the gradient stream's dict is read only around
step().
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Union

import torch
from torch.utils._pytree import tree_flatten

from . import _C

# The steps kept (the last ones); older steps are dropped, their count goes on (recorded).
STEPS_KEPT = 1000

_M = _C.StepMark


class StepStatsHooks:
    """The marks of one session's steps."""

    def __init__(self, runtime: "_C.Runtime", capacity: int = STEPS_KEPT) -> None:
        self.runtime = runtime
        self.recorder = _C.StepRecorder(capacity, ends_at_step=False)
        self._optimizer: Optional[weakref.ref] = None  # the optimizer watched (a CPUAdamW or any torch optimizer)
        self._cpu_step_ns: Optional[int] = None  # the gradient stream's time inside step(), read around step()
        self._in_backward = False

    # -- marks ---------------------------------------------------------------------------------------------------
    def _mark(self, mark: "_C.StepMark") -> None:
        self.recorder.mark(mark, self.runtime, self._cpu_step_ns)

    def forward_begin(self) -> None:
        self._mark(_M.forward_begin)

    def forward_end(self, output: Any) -> None:
        """The outermost training forward returned ``output``: its tensors' gradients begin the backward."""
        self._mark(_M.forward_end)
        self._in_backward = False
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_begin)

    def _backward_begin(self, grad: torch.Tensor) -> None:
        if self._in_backward:  # the model's second output tensor: the same backward
            return
        self._in_backward = True
        self._mark(_M.backward_begin)
        # Runs when autograd's engine finishes this backward (on the thread that called backward()).
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        self._in_backward = False
        self._mark(_M.backward_end)  # without an optimizer watched, a backward ends the step

    # -- the optimizer ---------------------------------------------------------------------------------------------
    def watch_optimizer(self, optimizer: Any) -> list:
        """Marks ``optimizer``'s step() (a torch optimizer's step hooks); from now on a step ends there. Returns
        the hooks' handles."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return []
        # Weakly both ways: the optimizer's hooks keep neither the session's runtime alive, nor the session the
        # optimizer (Note [Session lifetime]).
        self._optimizer = weakref.ref(optimizer)
        self.recorder.ends_at_step = True
        me = weakref.ref(self)

        def begin(*_: Any) -> None:
            hooks = me()
            if hooks is not None:
                hooks._step_begin()

        def end(*_: Any) -> None:
            hooks = me()
            if hooks is not None:
                hooks._step_end()

        return [optimizer.register_step_pre_hook(begin), optimizer.register_step_post_hook(end)]

    def _stream_ns(self) -> Optional[int]:
        """The CPU optimizer's time inside step() so far: the gradient stream's (its wait for the worker after
        backward, which includes the wait for gradient copies that land after backward, and the steps it redid
        there; Note [Stream timeline]) and the Python path's (a CPUAdamW's python_step_ns: what the stream left,
        every parameter with gradient accumulation or without a stream). None for an optimizer that counts neither
        (the runtime's CPU Adam time is then all inside step(), or 0)."""
        optimizer = self._optimizer() if self._optimizer is not None else None
        stream = getattr(optimizer, "_stream", None)
        python_ns = getattr(optimizer, "python_step_ns", None)
        if stream is None and python_ns is None:
            return None
        ns = int(python_ns or 0)
        if stream is not None:
            s = stream.stats()
            ns += int(round((s["step_wait_ms"] + s["step_kernel_ms"]) * 1e6))
        return ns

    def _step_begin(self) -> None:
        self._cpu_step_ns = self._stream_ns()
        self._mark(_M.step_begin)

    def _step_end(self) -> None:
        self._cpu_step_ns = self._stream_ns()
        self._mark(_M.step_end)

    # -- reading ---------------------------------------------------------------------------------------------------
    def steps(self) -> list:
        return self.recorder.steps()

    def last(self) -> Optional[dict]:
        return self.recorder.last()


def _session_stats(session: Any = None) -> StepStatsHooks:
    from ._wrap import current_session

    session = session if session is not None else current_session()
    hooks = getattr(session, "step_stats", None) if session is not None else None
    if hooks is None:
        raise _C.TierflowError("tierflow.step_stats: no wrapped model is alive (none was wrapped, or it was unwrapped "
                               "or deleted); call tierflow.wrap(model, optimizer) first")
    return hooks


def step_stats(last: bool = False, session: Any = None) -> Union[list, Optional[dict]]:
    """Per-step figures of the most recent ``wrap`` (Note [Step stats]): a list of dicts, one per training step,
    oldest first (the last 1000), or with ``last=True`` the newest step's dict (None before one ended).

    Each dict: ``step`` (1 for the first), ``forwards``/``backwards`` (micro-batches), ``wall_s``,
    ``forward_s``, ``backward_s``, ``step_s`` (the optimizer's step()), ``exposed_copy_wait_s`` (compute waited
    for an activation copy: the forward's copy-window waits and the backward's fetches), ``exposed_param_wait_s``
    (compute waited for a parameter fetch to land, TIERFLOW_OFFLOAD_PARAMS; apart from the activations' copies,
    the two add up), ``exposed_cpu_step_s`` (the CPU optimizer's time inside step(): what stuck out past
    backward, its wait for gradient copies that land after backward included; report()["plan"]["terms"] splits
    the two; the Python path's steps too, gradient accumulation's or without a gradient stream),
    ``exposed_nvme_wait_s``, bytes per link (``device_to_host_bytes``, ``host_to_device_bytes``,
    ``host_to_nvme_bytes``, ``nvme_to_host_bytes``), peaks per tier in the step (``peak_device_activation_bytes``,
    ``peak_pinned_host_bytes``, ``peak_nvme_bytes``: the most each tier held during the step, read from the meters'
    window peaks at each boundary, Note [Window peak]) and ``peaks_exact`` (False: a tier read without a window, a
    peak that is the highest reading at the step's boundaries, a lower bound).
    """
    hooks = _session_stats(session)
    return hooks.last() if last else hooks.steps()
