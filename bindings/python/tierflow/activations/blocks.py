"""The repeated blocks of a model, which the activation plans act on (Note [Finding blocks])."""

from __future__ import annotations

import torch


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model``, in registration order (Note [Finding blocks])."""
    def holds_params(m: torch.nn.Module) -> bool:
        return any(True for _ in m.parameters())

    def stacks(leaves: bool) -> list:
        # Each stack: two or more children of one module, of one class, each holding parameters.
        found = []
        for parent in model.modules():
            children = list(parent.children())
            if isinstance(parent, _CONTAINERS):
                if len(children) >= 2 and len({type(c) for c in children}) == 1 and all(map(holds_params, children)):
                    found.append(children)
            elif not leaves:
                by_class: dict = {}
                for c in children:
                    if not isinstance(c, _CONTAINERS) and any(True for _ in c.children()) and holds_params(c):
                        by_class.setdefault(type(c), []).append(c)
                found += [group for group in by_class.values() if len(group) >= 2]
        return found

    groups = stacks(leaves=True) or stacks(leaves=False)
    # The outermost stacks: one inside a member of another (a block's experts) is part of that block.
    inside = set()
    for group in groups:
        for member in group:
            inside.update(id(m) for m in member.modules() if m is not member)
    chosen = {id(m) for group in groups if not any(id(m) in inside for m in group) for m in group}
    return [m for m in model.modules() if id(m) in chosen]


_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)

# Note [Finding blocks]
# ~~~~~~~~~~~~~~~~~~~~~
# A block is one repetition of a model's stack of layers: what the activation
# plans act on. The stacks people write come as containers (nn.ModuleList:
# HF's decoders; nn.Sequential; nn.ModuleDict: torchtitan's layers) whose
# children are two or more modules of one class holding parameters, or, with no
# such container, as attributes of one module (self.block0, self.block1, ...):
# two or more children of one class that hold parameters and have submodules of
# their own (two nn.Linear or nn.Embedding side by side are layers, not a
# stack). Every such stack is taken, not only the largest: an encoder-decoder
# (T5, nn.Transformer) has two, and all four of a ResNet's stages are stacks.
# A stack inside a member of another stack is part of that member (Mixtral's
# experts are part of its decoder layer), so only the outermost stacks give
# blocks, listed in the order the model registers them (its forward order in
# every model of the zoo, tests/python/test_model_zoo.py). Blocks differ in
# class and size across stacks; each gets its own profile and plan. With no
# stack, there are no blocks: auto keeps every saved tensor where it fits and
# swaps them all where it does not (Note [Activation plans], AutoPlanner).

