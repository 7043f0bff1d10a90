"""The statistics report: a dict that prints as a table and saves as JSON."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from . import _C


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB', as the report prints bytes (tiering::report_bytes)."""
    return _C.report_bytes(float(n))


def write_json_atomic(path: str, obj: Any, **dump_args: Any) -> None:
    """Writes `obj` as JSON so that a reader never sees a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tierflow-", suffix=".json.tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, **dump_args)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Report(dict):
    """tierflow's statistics: peak bytes per tier, bytes per link, prefetch hits and stalls."""

    def __str__(self) -> str:
        """The table: tiering::report_text of the report's JSON (tiering/report_text.hpp)."""
        return _C.report_text(json.dumps(self, default=str, skipkeys=True))  # what JSON cannot hold is not printed

    def to_json(self) -> str:
        """The report as JSON text."""
        return json.dumps(self, indent=2, sort_keys=True)

    def save(self, path: str) -> None:
        """Writes the JSON atomically: a reader never sees a half-written file."""
        write_json_atomic(path, self, sort_keys=True)
