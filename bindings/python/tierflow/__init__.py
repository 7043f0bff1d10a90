"""tierflow: memory-tiered training offload for PyTorch.

Wrap an unchanged model and optimizer; saved activations go to the pinned
host tier and come back ahead of backward, and the optimizer steps on the CPU
from fp32 master weights::

    model, optimizer = tierflow.wrap(model, optimizer)
    ...  # the usual loop: loss.backward(); optimizer.step(); optimizer.zero_grad()
    print(tierflow.report())

Settings come from ``TIERFLOW_*`` environment variables (``config_table()``
lists them) and from keyword arguments of ``wrap``, which win.
"""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from . import _C
from ._C import ConfigError, OutOfMemoryError, TierflowError
from ._config import config_table, resolve_config
from .activations import replay_safe
from .activations.meter import SavedActivationMeter
from ._param_state import gathered
from ._report import Report
from ._wrap import Session, current_session, no_offload, report, unwrap, wrap
from .optim import CPUAdamW

__version__ = "0.1.0"

__all__ = [
    "CPUAdamW",
    "ConfigError",
    "OutOfMemoryError",
    "Report",
    "SavedActivationMeter",
    "Session",
    "TierflowError",
    "config_table",
    "current_session",
    "gathered",
    "no_offload",
    "replay_safe",
    "report",
    "resolve_config",
    "unwrap",
    "wrap",
]
