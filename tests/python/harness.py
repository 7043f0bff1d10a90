"""Trains a model with and without tierflow on the same data and seed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from gpt import GPT, CharData, GPTConfig, gpt_loss, make_text


@dataclass
class Run:
    losses: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    report: Optional[dict] = None
    meter_peak: int = 0


@dataclass
class Task:
    """A model factory, a batch factory and a loss."""
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def gpt_task(layers: int = 2, width: int = 64, block: int = 64, batch: int = 8, dropout: float = 0.1) -> Task:
    data = CharData(make_text(600), block)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=block, n_layer=layers, n_head=4,
                    n_embd=width, dropout=dropout)

    def batch_fn(i: int) -> tuple:
        return data.batch(batch, torch.Generator().manual_seed(1000 + i))

    return Task(lambda: GPT(cfg), batch_fn, lambda m, b: gpt_loss(m, *b))


def encoder_task() -> Task:
    def make():
        layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), nn.Linear(64, 8))

    def batch_fn(i: int) -> tuple:
        g = torch.Generator().manual_seed(2000 + i)
        return torch.randn(8, 32, 64, generator=g), torch.randint(0, 8, (8, 32), generator=g)

    def loss(m, b):
        out = m(b[0])
        return F.cross_entropy(out.reshape(-1, 8), b[1].reshape(-1))

    return Task(make, batch_fn, loss)


def cnn_task() -> Task:
    def make():
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
            nn.Flatten(), nn.Linear(32 * 16, 10))

    def batch_fn(i: int) -> tuple:
        g = torch.Generator().manual_seed(3000 + i)
        return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)

    return Task(make, batch_fn, lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def train(task: Task, steps: int, use_tierflow: bool, *, accumulate: int = 1, lr: float = 1e-3,
          weight_decay: float = 0.01, optimizer_cls=torch.optim.AdamW, scheduler=None,
          **settings) -> Run:
    torch.manual_seed(0)
    model = task.make_model()
    opt = optimizer_cls(model.parameters(), lr=lr, weight_decay=weight_decay)
    meter = None
    if use_tierflow:
        model, opt = tierflow.wrap(model, opt, **settings)
    else:
        meter = tierflow.SavedActivationMeter()
    sched = scheduler(opt) if scheduler else None
    run = Run()
    for step in range(steps):
        total = 0.0
        for micro in range(accumulate):
            batch = task.make_batch(step * accumulate + micro)
            if meter is not None:
                meter.begin_forward()
                with meter.hooks():
                    loss = task.loss(model, batch)
            else:
                loss = task.loss(model, batch)
            (loss / accumulate).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched:
            sched.step()
        run.losses.append(total)
    run.params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if use_tierflow:
        run.report = tierflow.report()
    else:
        run.meter_peak = meter.peak_bytes
    return run


def assert_bit_identical(a: Run, b: Run) -> None:
    assert a.losses == b.losses, f"losses differ: {a.losses} vs {b.losses}"
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), f"parameter {k} differs"


def assert_close(a: Run, b: Run, rtol: float = 1e-6, param_atol: float = 5e-5) -> None:
    """Losses within `rtol`; parameters within `rtol` or `param_atol`.

    The optimizer's own error is ~1 ulp per step (checked per step at 1e-6 in
    test_optimizer.py). Across steps, parameters whose exact gradient is zero
    (attention key biases: softmax ignores a constant shift of the keys) get
    gradients of pure rounding noise, which Adam normalises to lr-sized
    steps; they drift by up to ~1e-5 while every loss still agrees to 1e-6.
    """
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert abs(x - y) <= rtol * abs(x), f"step {i}: loss {x} vs {y} (rel {abs(x - y) / abs(x):.2e})"
    for k in a.params:
        if a.params[k].is_floating_point():
            torch.testing.assert_close(b.params[k], a.params[k], rtol=rtol, atol=param_atol, msg=f"parameter {k}")
        else:
            assert torch.equal(a.params[k], b.params[k]), k
