"""The profile file: a model's recorded block profiles, links and fixed device bytes, as JSON.

The activation planner's inputs as ``auto`` measures them (TIERFLOW_PROFILE writes and reads them) and as
``python -m tierflow plan --profile`` reads them.

-------------
A recorded profile is JSON; tierflow's profiler writes it and ``--profile``
reads it (``profile_to_json`` / ``profile_from_json``)::

    {"format": "tierflow-profile", "version": 1,
     "blocks": [{"forward_seconds": f, "backward_seconds": f, "input_bytes": n, "whole_bytes": n,
                 "split_bytes": n, "split_recompute_seconds": f, "cheap_bytes": n,
                 "cheap_recompute_seconds": f, "splittable": b, "transient_bytes": n,
                 "upload_bytes": n, "download_bytes": n}, ...],
     "links": {"d2h": f, "h2d": f, "duplex": f, "nvme_write": f, "nvme_read": f},
     "fixed_device_bytes": n}

``blocks`` are in forward order, one per repeated block (at most the
``layers`` limit of ``tierflow._C.transformer_shape_limits()``), fields as in
``tierflow._C.BlockProfile`` (a missing field takes its default, an unknown one
is an error); ``links`` are bytes per second (0: absent); ``fixed_device_bytes``
is what the rest of training needs on the device (parameters, gradients,
optimizer states, workspace, the activations outside the blocks). Times and
bandwidths are finite numbers >= 0, byte counts integers from 0 to 2^64 - 1,
``splittable`` a boolean; anything else is an error naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from .. import _C

PROFILE_FORMAT = "tierflow-profile"
PROFILE_VERSION = 1
BLOCK_FIELDS = ("forward_seconds", "backward_seconds", "input_bytes", "whole_bytes", "split_bytes",
                "split_recompute_seconds", "cheap_bytes", "cheap_recompute_seconds", "splittable",
                "transient_bytes", "upload_bytes", "download_bytes")
LINK_FIELDS = ("d2h", "h2d", "duplex", "nvme_write", "nvme_read")
U64_MAX = (1 << 64) - 1


@dataclass
class Profile:
    """A recorded profile: the blocks, the links and the device bytes the rest of training needs."""

    blocks: list  # of _C.BlockProfile
    links: Any  # _C.Links
    fixed_device_bytes: int


def profile_to_json(blocks: Sequence[Any], links: Any, fixed_device_bytes: int) -> str:
    """The profile file's text (see the module's doc). `blocks` are BlockProfiles or dicts of their fields."""
    def block_dict(b: Any) -> dict:
        if isinstance(b, dict):
            return {k: b[k] for k in BLOCK_FIELDS if k in b}
        return {k: getattr(b, k) for k in BLOCK_FIELDS}
    link = links if isinstance(links, dict) else {k: getattr(links, k) for k in LINK_FIELDS}
    return json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                       "blocks": [block_dict(b) for b in blocks], "links": link,
                       "fixed_device_bytes": int(fixed_device_bytes)}, indent=1)


def _profile_value(where: str, name: str, value: Any) -> Any:
    """A profile field checked for its kind: seconds and bandwidths, byte counts, or splittable."""
    if name == "splittable":
        ok, accepted = isinstance(value, bool), "true or false"
    elif name.endswith("_bytes"):
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX
        accepted = "an integer from 0 to 2^64 - 1"
    else:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and value >= 0)
        accepted = "a finite number >= 0"
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"profile: {where}{name} {shown} is not valid; accepted: {accepted}")
    return value


def profile_from_json(text: str) -> Profile:
    """Parses a profile file's text; raises ValueError saying what is wrong (one line)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer of too many digits, deep nesting
        raise ValueError(f"profile: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("blocks"), list) or not data["blocks"]:
        raise ValueError('profile: expected an object with a non-empty "blocks" list')
    if data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT or data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        raise ValueError(f"profile: format {data.get('format')!r} version {data.get('version')!r} is not "
                         f"{PROFILE_FORMAT!r} version {PROFILE_VERSION}")
    most = _C.transformer_shape_limits()["layers"]
    if len(data["blocks"]) > most:
        raise ValueError(f"profile: {len(data['blocks'])} blocks is not valid; accepted: 1 to {most} blocks")
    blocks = []
    for i, b in enumerate(data["blocks"]):
        if not isinstance(b, dict):
            raise ValueError(f"profile: block {i} is not an object; accepted: an object of {list(BLOCK_FIELDS)}")
        unknown = set(b) - set(BLOCK_FIELDS)
        if unknown:
            raise ValueError(f"profile: block {i} has unknown fields {sorted(unknown)}; known: {list(BLOCK_FIELDS)}")
        blocks.append(_C.BlockProfile(**{k: _profile_value(f"block {i} ", k, v) for k, v in b.items()}))
    links = data.get("links", {})
    if not isinstance(links, dict):
        raise ValueError(f"profile: links is not an object; accepted: an object of {list(LINK_FIELDS)}")
    unknown = set(links) - set(LINK_FIELDS)
    if unknown:
        raise ValueError(f"profile: links has unknown fields {sorted(unknown)}; known: {list(LINK_FIELDS)}")
    links = {k: _profile_value("links ", k, v) for k, v in links.items()}
    fixed = _profile_value("", "fixed_device_bytes", data.get("fixed_device_bytes", 0))
    return Profile(blocks, _C.Links(**links), fixed)
