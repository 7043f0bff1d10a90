"""Offloaded parameters' bookkeeping keeps no autograd graph alive past its step (Note [Who holds a call] in
bindings/python/tierflow/params.py).

A call's record (params._Call) lives as long as its graph: the gradient hooks on its outputs hold it, and it holds
the last nodes it counts. Where a last node is one of those outputs' nodes (a residual block's ``x + f(x)``, an
embedding) or above one (_Branch's ``a * x`` above its output ``a``), the record held a node that held the record:
a cycle through autograd's C++ hooks, which Python's collector frees one call per collection at best, so every
step's graph (nodes, saved tensors) piled up (the loop fuzzer, seed 3, mlp_bn under auto: 46 nodes and 12 records
alive after 3 steps, 86 and 23 after 8; offload_params="host" alone too). Checked to fail without the fix: holding
every last node, or every one but the outputs' own nodes (then _Branch's cycle holds every call before it), leaves
10 records and 50 nodes after 2 steps, 30 and 138 after 4 more.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import tierflow
from tierflow.params import _Call


class _Residual(nn.Module):
    """A block whose output's node is one of its call's last nodes (the add's edge to the block's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.fc(x)))


class _Branch(nn.Module):
    """A unit of its own (it holds its weight) with two outputs: ``a``, whose node is a last node, and one from a
    last node (``a * x``'s, with its edge to the input) above ``a``'s node."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple:
        a = x @ self.w
        return a * x + 1.0, a


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(_Residual() for _ in range(3))
        self.branch = _Branch()
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        h, a = self.branch(x)
        return self.out(h + a)


def _alive() -> tuple:
    """The parameter records and the autograd nodes alive after one collection."""
    gc.collect()
    objs = gc.get_objects()
    calls = sum(1 for o in objs if type(o) is _Call)
    nodes = sum(1 for o in objs if isinstance(o, torch.autograd.graph.Node))
    return calls, nodes


def _settled() -> tuple:
    """_alive() once collections stop freeing anything (what other tests left may need several)."""
    now, last = _alive(), None
    while now != last:
        now, last = _alive(), now
    return now


def _train(steps: int, acts: str, params: str) -> tuple:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # (steps the host copies: the emulated device only)
    model, opt = tierflow.wrap(model, opt, device="emulated", offload_params=params, offload_activations=acts,
                               offload_optimizer="none", min_offload_bytes=0)
    for step in range(steps):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tierflow.unwrap(model)
    del model, opt
    return _alive()


@pytest.mark.ordering
@pytest.mark.parametrize("acts,params", [("none", "host"), ("auto", "auto")])
def test_no_call_or_node_outlives_its_step(acts, params):
    """After training and one collection, nothing of a step's graph is left, and what is left (other tests'
    graphs) does not grow with the steps: 2 steps and 4 leave the same."""
    before = _settled()
    short = _train(2, acts, params)
    long = _train(4, acts, params)
    assert short == before and long == before, (
        f"(records, nodes) alive: {before} before, {short} after 2 steps, {long} after 4 more")
