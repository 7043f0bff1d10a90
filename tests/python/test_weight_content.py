"""Weights known by their content (Note [Weight content] in tierflow/optim/adamw.py).

The CPU AdamW keeps an fp32 master of each weight on the host and writes the parameter from it at every step. A
user's write to the parameter since tierflow's last one (p.data.clamp_() after step(), WGAN's weight clipping; an
edit between backward() and step()) is seen by the parameter's bytes, and the master is re-read from it, as
torch's AdamW steps from whatever p holds. Compared with torch.optim.AdamW (within the CPU AdamW's rounding) and,
bit for bit, between stepping during backward and in step()."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tierflow

from harness import torch_device

STEPS = 4


def mlp(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(
        torch_device(device))


def clip_weights(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)


def run(device: str, when: str, **settings) -> tuple:
    """STEPS steps with the weights clipped through p.data ``when``: "after" step() or "before" it (after
    backward); settings: tierflow.wrap's (none: plain torch)."""
    model = mlp(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if settings:
        model, opt = tierflow.wrap(model, opt, device=device, offload_activations="none", **settings)
    for i in range(STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i)).to(torch_device(device))
        model(x).square().mean().backward()
        if when == "before":
            clip_weights(model)
        opt.step()
        opt.zero_grad()
        if when == "after":
            clip_weights(model)
    stats = dict(opt.overlap_stats) if settings else None
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, stats


@pytest.mark.parametrize("when, weights_return", [("after", "step"), ("before", "step"), ("before", "forward")])
def test_weights_written_through_p_data_are_stepped_from(device, when, weights_return):
    """(With TIERFLOW_WEIGHTS_RETURN=forward the new weights are still on their way after step(): a write to a
    parameter before the next forward races them, docs/models.md.)"""
    base, _ = run(device, when)
    on, stats = run(device, when, weights_return=weights_return)
    off, _ = run(device, when, overlap_step="off")
    for k in base:
        torch.testing.assert_close(on[k], base[k], rtol=1e-6, atol=1e-6, msg=k)
        assert torch.equal(on[k], off[k]), f"{k}: stepping during backward differs from stepping in step()"
    assert stats["early_steps"] > 0 and stats["taken_back"] > 0, stats  # the early steps read stale masters


def test_unwritten_weights_keep_every_early_step(device):
    """The check costs no right early step: with no user write, every one commits."""
    _, stats = run(device, "never", weights_return="step")
    assert stats["committed"] == stats["early_steps"] > 0 and stats["taken_back"] == 0, stats


class TwoBranches(nn.Module):
    """Branch b runs at even steps only: at odd steps its parameters get no gradient (set_to_none)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)
        self.use_b = True

    def forward(self, x):
        return self.a(x) + (self.b(x) if self.use_b else 0)


def run_variant(device: str, variant: str, **settings) -> dict:
    torch.manual_seed(0)
    if variant == "channels_last":  # not contiguous: the Python path steps them
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    else:
        model = TwoBranches()
    model = model.to(torch_device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if settings:
        model, opt = tierflow.wrap(model, opt, device=device, offload_activations="none", **settings)
    for i in range(STEPS + 1):
        g = torch.Generator().manual_seed(i)
        if variant == "channels_last":
            x = torch.randn(2, 3, 8, 8, generator=g).to(torch_device(device))
        else:
            model.use_b = i % 2 == 0
            x = torch.randn(8, 16, generator=g).to(torch_device(device))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clip_weights(model)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k != "use_b"}


@pytest.mark.parametrize("variant, settings", [
    ("branch", {}), ("branch", {"overlap_step": "off"}), ("branch", {"offload_gradients": "on"}),
    ("channels_last", {})], ids=["no-gradient-then", "no-gradient-then-off", "offload-gradients", "channels-last"])
def test_a_write_is_seen_whatever_the_step_that_finds_it(device, variant, settings):
    """From review: a write found at a step where the parameter has no gradient was forgotten (its next early
    step committed from the old master); a parameter whose content is not known (not contiguous) was never
    re-read; with offload_gradients="on" the step that found a write failed its own consistency check."""
    base = run_variant(device, variant)
    tier = run_variant(device, variant, **settings)
    for k in base:
        torch.testing.assert_close(tier[k], base[k], rtol=1e-6, atol=1e-6, msg=k)
