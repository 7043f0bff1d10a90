"""The configuration table (see Note [One configuration table] in core/). Torch-free: it reads tierflow._core
(Note [Two extensions] in bindings/src/core_module.cpp), so the command line needs no torch."""

from __future__ import annotations

import os
from typing import Any, Mapping

from . import _core  # the torch-free extension; _C re-exports its names


def config_table() -> list[dict[str, str]]:
    """Every ``TIERFLOW_*`` variable: ``name``, ``default``, ``accepted``, ``doc``."""
    return _core.config_table()


def settings_to_strings(settings: Mapping[str, Any]) -> dict[str, str]:
    """Keyword arguments as the text the C++ parser reads (lists join with commas)."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple, set, frozenset, dict)):  # a list setting's value only (core/config.hpp)
            why = _core.collection_value_refusal(str(key), isinstance(value, (list, tuple)), type(value).__name__,
                                                 repr(value))
            if why:
                raise _core.ConfigError(why)
            value = ",".join(str(v) for v in value)
        text = str(value)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: undecodable bytes that came through os.fsdecode or argv
            raise _core.ConfigError(f"{key}={text!r} is not valid (not UTF-8 text); accepted: the forms of "
                                 f"TIERFLOW_{str(key).upper()} in tierflow.config_table()") from None
        out[key] = text
    return out


def resolve_config(**settings: Any) -> dict[str, str]:
    """The settings in force for these keyword arguments plus the environment.

    Raises ``tierflow.ConfigError`` naming an unknown or malformed setting.
    """
    return _core.resolve_config(settings_to_strings(settings))


def resolve_settings(**settings: Any) -> Any:
    """The same, typed (``tierflow._C.Settings``, which is ``tierflow._core.Settings``: ints for bytes, bools for
    switches, the table's names for choices; Note [Typed settings] in bindings/src/core_module.cpp): what Python
    code reads."""
    return _core.resolve_settings(settings_to_strings(settings))

