"""The configuration table (see Note [One configuration table] in core/)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from . import _C


def config_table() -> list[dict[str, str]]:
    """Every ``TIERFLOW_*`` variable: ``name``, ``default``, ``accepted``, ``doc``."""
    return _C.config_table()


def settings_to_strings(settings: Mapping[str, Any]) -> dict[str, str]:
    """Keyword arguments as the text the C++ parser reads (lists join with commas)."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        text = str(value)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: undecodable bytes that came through os.fsdecode or argv
            raise _C.ConfigError(f"{key}={text!r} is not valid (not UTF-8 text); accepted: the forms of "
                                 f"TIERFLOW_{str(key).upper()} in tierflow.config_table()") from None
        out[key] = text
    return out


def resolve_config(**settings: Any) -> dict[str, str]:
    """The settings in force for these keyword arguments plus the environment.

    Raises ``tierflow.ConfigError`` naming an unknown or malformed setting.
    """
    return _C.resolve_config(settings_to_strings(settings))


def set_explicitly(name: str) -> bool:
    """Whether the ``TIERFLOW_*`` variable ``name`` is set in the environment, not left at its default
    (``python -m tierflow plan`` budgets the whole device when TIERFLOW_GPU_MEMORY is not set): the C++
    table's answer (Config::given)."""
    return name in _C.config_given({})
