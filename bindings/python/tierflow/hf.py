"""tierflow's transformers integrations, by their public name: ``tierflow.hf.StepStatsCallback`` (hf_callback.py).

Importing this module does not import transformers; a name is made on first use, when transformers is needed."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from . import hf_callback

    return getattr(hf_callback, name)
