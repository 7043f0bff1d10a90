"""``tierflow.trace(path)``: a trace of the steps run inside it, in the Chrome trace format that torch.profiler
exports and Perfetto opens (Note [Trace] in core/include/tierflow/core/trace.hpp).

    with tierflow.trace("step.json"):
        train_one_step()

The recorder is C++ (the copies, NVMe requests and CPU AdamW buckets record themselves there); this module adds
the blocks' spans (forward, backward, replay: activations/runner.py and frame.py call ``begin``/``end`` and
``span``), each also a ``torch.profiler.record_function`` range while a torch profiler runs, so that tierflow's
ranges appear inside torch's own trace. ``trace.merge`` puts a tierflow trace and torch.profiler's exported one
into one file on one clock (``python -m tierflow timeline TRACE --merge TORCH.json -o merged.json`` does the same).
``TIERFLOW_TRACE=path`` records every step of a wrapped model's runtime and writes the file when the runtime ends.

Times: the recorder's clock is the steady clock, which is Python's ``time.monotonic_ns()`` (both CLOCK_MONOTONIC
on Linux); the file's ``ts`` are CLOCK_REALTIME microseconds since its ``baseTimeNanoseconds``, as Kineto's are.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import torch

from . import _C

__all__ = ["trace"]

Lane = _C.TraceLane
_profiling = torch.autograd._profiler_enabled  # a torch.profiler (or autograd profiler) records now
_record_function = torch.autograd.profiler.record_function


class trace:
    """Records a trace while inside; writes it to ``path`` on leaving (the events that ended inside).

    ``path``: a file path under a writable folder. Nested traces and TIERFLOW_TRACE record the same events: each
    writes the ones of its own time."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise _C.ConfigError(f"tierflow.trace(path={path!r}): give a file path under a writable folder")
        # The file is written on leaving: refuse now a folder that is missing or cannot be written (core's probe,
        # the same as TIERFLOW_TRACE's at wrap).
        why = _C.trace_path_refusal(path, f"tierflow.trace(path={path!r})")
        if why:
            raise _C.ConfigError(why)
        self.path = path
        self._since: Optional[int] = None

    def __enter__(self) -> "trace":
        _C.trace_start()
        self._since = time.monotonic_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            sample()  # a last reading of the tiers
            _C.trace_write(self.path, self._since or 0)
        except Exception as e:
            message = f"tierflow.trace(path={self.path!r}): the trace was not written: {e}"
            if exc_type is not None:  # the body's own exception goes on; this one is only said
                import warnings
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            else:
                raise _C.TierflowError(message) from e
        finally:
            _C.trace_stop()
        return False

    @staticmethod
    def merge(tierflow_path: str, torch_path: str, out_path: str) -> dict:
        """Writes one Chrome trace with a tierflow trace's events and torch.profiler's exported one's, on one
        clock (Note [Trace]); returns it (a dict)."""
        from .cli.timeline import merge_files
        return merge_files(tierflow_path, torch_path, out_path)


# ---- the blocks' spans (called from activations/runner.py and frame.py) ------------------------------------


def on() -> bool:
    """Whether anything records a block's span now: tierflow's trace or a torch profiler."""
    return _C.trace_on() or _profiling()


def begin(name: str) -> Optional[tuple]:
    """Starts a span named ``name``: (start ns, the record_function range or None, name); None when nothing
    records. ``end`` ends it."""
    rf = None
    if _profiling():
        rf = _record_function(name)
        rf.__enter__()
    elif not _C.trace_on():
        return None
    return (time.monotonic_ns(), rf, name)


def end(span: Optional[tuple], lane: Any, **args: int) -> None:
    """Ends a span ``begin`` started: its torch range, and its event on ``lane`` with ``args`` (integers), then a
    reading of the bytes per tier."""
    if span is None:
        return
    t0, rf, name = span
    if rf is not None:
        rf.__exit__(None, None, None)
    if _C.trace_on():
        _C.trace_complete(lane, name, t0, time.monotonic_ns(), list(args.items()))
        _C.trace_sample()


def sample() -> None:
    """A reading of the bytes per tier from every runtime's meters (nothing when the trace is off)."""
    _C.trace_sample()


class span:
    """``with span(lane, name, block=i):`` a span around a region of one thread (a block's replay)."""

    __slots__ = ("lane", "name", "args", "_span")

    def __init__(self, lane: Any, name: str, **args: int) -> None:
        self.lane, self.name, self.args = lane, name, args
        self._span: Optional[tuple] = None

    def __enter__(self) -> "span":
        self._span = begin(self.name)
        return self

    def __exit__(self, *exc: Any) -> bool:
        end(self._span, self.lane, **self.args)
        return False


class BackwardMarks:
    """One block forward's backward span: ``start`` is a gradient hook on its output (its backward begins),
    ``end`` one on its first input (its backward is done). Only while tierflow's trace records."""

    __slots__ = ("index", "t0")

    def __init__(self, index: int) -> None:
        self.index = index
        self.t0: Optional[int] = None

    def start(self, grad: torch.Tensor) -> None:
        if self.t0 is None:
            self.t0 = time.monotonic_ns()

    def end(self, grad: torch.Tensor) -> None:
        global _last_backward_end
        if self.t0 is not None and _C.trace_on():
            now = time.monotonic_ns()
            # The gradient that starts this block's backward is the one that ends the next block's: both hooks
            # on one tensor, this block's first. Its span starts where the one ended last ends (one lane, no
            # overlap).
            t0 = min(max(self.t0, _last_backward_end), now)
            _last_backward_end = now
            _C.trace_complete(Lane.backward, f"block {self.index} backward", t0, now, [("block", self.index)])
            _C.trace_sample()
        self.t0 = None


_last_backward_end = 0  # monotonic ns: the last block backward's end (BackwardMarks.end)
