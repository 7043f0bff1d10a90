"""The profile file: a model's recorded block profiles, links and fixed device bytes, as JSON.

Its format, its text and every check of a file read back are tiering's (tiering/profile_file.hpp,
Note [Profile file]); this module keeps the names the rest of the package imports."""

from __future__ import annotations

from typing import Any, Sequence

from .. import _C

PROFILE_FORMAT = _C.PROFILE_FORMAT
PROFILE_VERSION = _C.PROFILE_VERSION
BLOCK_FIELDS = _C.PROFILE_BLOCK_FIELDS
LINK_FIELDS = _C.PROFILE_LINK_FIELDS
Profile = _C.ProfileFile  # blocks (BlockProfile), links (Links), fixed_device_bytes


def profile_to_json(blocks: Sequence[Any], links: Any, fixed_device_bytes: int) -> str:
    """The profile file's text. `blocks` are BlockProfiles or dicts of their fields, `links` Links or a dict
    (a field left out is written with its default)."""
    blocks = [_C.BlockProfile(**b) if isinstance(b, dict) else b for b in blocks]
    return _C.profile_to_json(blocks, _C.Links(**links) if isinstance(links, dict) else links,
                              int(fixed_device_bytes))


def profile_from_json(text: str) -> Profile:
    """Parses a profile file's text; raises ValueError (ConfigError) saying what is wrong (one line)."""
    return _C.profile_from_json(text)
