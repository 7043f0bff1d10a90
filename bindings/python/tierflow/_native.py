"""tierflow's C++ names for code that may run without torch (the command line): ``_native.X`` is
``tierflow._core.X`` when the torch-free extension has it, else ``tierflow._C.X``, which loads torch (then _C) on
that first use (Note [Two extensions] in bindings/src/core_module.cpp). The objects are the same either way: _C
re-exports _core's names.

``profile_from_json`` is tiering's parser of a profile file (tierflow.activations.profile's, without the
activations package, which imports torch)."""

from __future__ import annotations

from typing import Any

from ._core import *  # noqa: F401,F403  (every public name of the torch-free extension)
from ._core import profile_from_json  # noqa: F401


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _C  # through the package: torch first

    return getattr(_C, name)
