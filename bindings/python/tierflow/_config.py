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
        if isinstance(value, (list, tuple, set, frozenset, dict)):
            _check_takes_a_list(str(key), value)
            value = ",".join(str(v) for v in value)
        text = str(value)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: undecodable bytes that came through os.fsdecode or argv
            raise _core.ConfigError(f"{key}={text!r} is not valid (not UTF-8 text); accepted: the forms of "
                                 f"TIERFLOW_{str(key).upper()} in tierflow.config_table()") from None
        out[key] = text
    return out


def _check_takes_a_list(key: str, value: Any) -> None:
    """A list is the value of a list setting (TIERFLOW_NVME_PATHS) only: given for a size or a word it would be
    joined with commas and refused as a malformed value that the user never wrote."""
    name = "TIERFLOW_" + key.upper().removeprefix("TIERFLOW_")
    row = next((r for r in config_table() if r["name"] == name), None)
    if row is None:  # an unknown setting: the C++ table names the closest one
        return
    if isinstance(value, (list, tuple)) and "list" in row["accepted"]:
        return
    raise _core.ConfigError(f"{key}={value!r} ({name}) is a {type(value).__name__}, where one value is expected; "
                         f"accepted: {row['accepted']}")


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

