"""``StepStatsCallback``: tierflow's per-step figures in a transformers Trainer's logs (Note [Step stats]).

Usage::

    from tierflow.hf_callback import StepStatsCallback
    trainer = transformers.Trainer(model=model, args=args, optimizers=(optimizer, scheduler),
                                   callbacks=[StepStatsCallback()])

Every time the Trainer logs (``logging_steps``), the steps since its last log are summed up
(``_C.StepRecorder.mean_since``: times, waits and bytes as their mean per step, peaks as the highest) and added to
the logs as ``tierflow/<name>`` (``tierflow/forward_s``, ``tierflow/exposed_cpu_step_s``,
``tierflow/device_to_host_bytes``, ``tierflow/peak_pinned_host_bytes``, ...), so they reach whatever the Trainer
reports to (``report_to``: TensorBoard, W&B, MLflow, ...) and its console lines. The Trainer calls its callbacks
in order and hands the reporters the logs in their own ``on_log``; the callback moves itself ahead of them when
training begins, so the figures are in the logs they receive.

Importing this module does not import transformers; the class is made on first use, when transformers is needed.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

PREFIX = "tierflow/"


def _make_callback_class() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tierflow.hf_callback.StepStatsCallback is a transformers TrainerCallback: install "
                          "transformers (pip install transformers) to use it") from e

    from ._step_stats import _session_stats

    class StepStatsCallback(TrainerCallback):
        """Adds tierflow.step_stats() of the steps since the Trainer's last log to its logs (``tierflow/``)."""

        def __init__(self, session: Any = None) -> None:
            self._session = session  # default: the most recent wrap's, looked up when training begins
            self._after: Optional[int] = None  # the last step already logged

        def _hooks(self) -> Any:
            return _session_stats(self._session)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._after = self._hooks().recorder.recorded  # steps before training are not this run's
            handler = getattr(sys._getframe(1), "f_locals", {}).get("self")  # the CallbackHandler calling us
            callbacks = getattr(handler, "callbacks", None)
            if isinstance(callbacks, list) and self in callbacks and callbacks[0] is not self:
                callbacks.remove(self)  # ahead of the reporters, which read the logs in their own on_log
                callbacks.insert(0, self)

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
            if logs is None:
                return
            recorder = self._hooks().recorder
            summary = recorder.mean_since(self._after if self._after is not None else 0)
            if summary is None:  # no step ended since the last log (an evaluation's log)
                return
            self._after = int(summary.pop("step"))
            for name, value in summary.items():
                logs[PREFIX + name] = float(value)

    StepStatsCallback.__module__ = __name__
    StepStatsCallback.__qualname__ = "StepStatsCallback"
    return StepStatsCallback


def __getattr__(name: str) -> Any:
    if name == "StepStatsCallback":
        cls = _make_callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
