"""The repeated blocks of a model, which the activation plans act on (Note [Finding blocks] in
tiering/block_finder.hpp: tiering::find_blocks decides over the module tree described here)."""

from __future__ import annotations

import torch

from .. import _C


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model``, in registration order (Note [Finding blocks])."""
    modules = list(model.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    types: dict = {}  # class -> its number
    nodes = [(types.setdefault(type(m), len(types)), isinstance(m, _CONTAINERS), any(True for _ in m.parameters()),
              [index[id(c)] for c in m.children()]) for m in modules]
    return [modules[i] for i in _C.find_blocks(nodes)]


_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
