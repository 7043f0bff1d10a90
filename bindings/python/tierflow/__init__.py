"""tierflow: memory-tiered training offload for PyTorch.

Wrap an unchanged model and optimizer; saved activations go to the pinned
host tier and come back ahead of backward, and the optimizer steps on the CPU
from fp32 master weights::

    model, optimizer = tierflow.wrap(model, optimizer)
    ...  # the usual loop: loss.backward(); optimizer.step(); optimizer.zero_grad()
    print(tierflow.report())

Settings come from ``TIERFLOW_*`` environment variables (``config_table()``
lists them) and from keyword arguments of ``wrap``, which win.

``import tierflow`` loads torch only when a name that needs it is first used
(``wrap``, ``report``, ``_C``, ...): the settings, the errors and the command
line (``python -m tierflow plan`` with the figures given) are torch-free
(Note [Two extensions] in bindings/src/core_module.cpp).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ._core import ConfigError, OutOfMemoryError, StallError, TierflowError
from ._config import config_table, resolve_config

__version__ = "0.1.0"

__all__ = [
    "CPUAdamW",
    "ConfigError",
    "OutOfMemoryError",
    "Report",
    "SavedActivationMeter",
    "Session",
    "StallError",
    "TierflowError",
    "config_table",
    "current_session",
    "gathered",
    "no_offload",
    "replay_safe",
    "report",
    "resolve_config",
    "step_stats",
    "trace",
    "unwrap",
    "wrap",
]

# The names that need torch: where each lives (loaded on first use, PEP 562).
_LAZY = {
    "CPUAdamW": ".optim",
    "Report": "._report",
    "SavedActivationMeter": ".activations.meter",
    "Session": "._wrap",
    "current_session": "._wrap",
    "gathered": "._param_state",
    "no_offload": "._wrap",
    "replay_safe": ".activations",
    "report": "._wrap",
    "step_stats": "._step_stats",
    "trace": "._trace",
    "unwrap": "._wrap",
    "wrap": "._wrap",
}

# The package's torch-free modules: `from tierflow import cli` must not load torch on the way.
_TORCH_FREE = {"_config", "_core", "_native", "cli"}


def _torch_part(module: str) -> Any:
    """Imports a module of the package that needs torch, torch first (libtorch before _C, which links it)."""
    import torch  # noqa: F401

    return importlib.import_module(module, __name__)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(_torch_part(_LAZY[name]), name)
    elif name in _TORCH_FREE:
        value = importlib.import_module(f".{name}", __name__)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = _torch_part(f".{name}")  # a submodule (_C, optim, activations, ...), as eager imports made them
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
