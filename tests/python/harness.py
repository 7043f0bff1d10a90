"""Trains a model with and without tierflow on the same device, data and seed.

Every test that wraps a model runs on each device tierflow drives (see the
``device`` fixture in conftest.py): ``"emulated"`` (CPU tensors are the device
tensors; forced with ``device="emulated"`` even on a GPU machine) and
``"cuda"`` (model and batches on the GPU, ``device="cuda"``). The baseline
runs on the same device with the same seed and data, so a comparison never
mixes devices.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from gpt import GPT, CharData, GPTConfig, gpt_loss, make_text

# ---- devices ---------------------------------------------------------------------------------------------------


def cuda_usable() -> bool:
    """Whether the [cuda] cases can run: a GPU torch can use and tierflow's CUDA backend."""
    return torch.cuda.is_available() and tierflow._C.cuda_available()


def _why_no_cuda() -> str:
    torch_side = "torch sees a CUDA GPU" if torch.cuda.is_available() else "torch sees no CUDA GPU"
    if not tierflow._C.cuda_compiled():
        ours = "tierflow was built without its CUDA backend"
    elif not tierflow._C.cuda_available():
        ours = "tierflow's CUDA backend finds no usable GPU"
    else:
        ours = "tierflow's CUDA backend is usable"
    return f"needs a CUDA GPU and tierflow's CUDA backend; this machine has none ({torch_side}; {ours})"


CUDA_SKIP_REASON = "" if cuda_usable() else _why_no_cuda()
needs_cuda = pytest.mark.skipif(not cuda_usable(), reason=CUDA_SKIP_REASON or "unused")
# Parameters of the `device` fixture: the test id carries the device.
DEVICES = ["emulated", pytest.param("cuda", marks=needs_cuda)]
# Variables the Makefile sets for the whole suite (it runs it once per mode of the emulated device).
KEPT_ENVIRONMENT = ("TIERFLOW_EMULATED_DEVICE", "TIERFLOW_EMULATED_SEED")


def torch_device(device: str) -> torch.device:
    """Where tensors live on tierflow's `device`: the emulated device's tensors are CPU tensors."""
    if device not in ("emulated", "cuda"):
        raise ValueError(f"device must be 'emulated' or 'cuda', got {device!r}")
    return torch.device("cuda" if device == "cuda" else "cpu")


def to_device(batch: tuple, device: str, dtype: torch.dtype = torch.float32) -> tuple:
    """A batch built on the CPU (seeded generators are CPU ones) moved to `device`; floats cast to `dtype`."""
    dev = torch_device(device)
    return tuple(t.to(dev, dtype) if t.is_floating_point() else t.to(dev) for t in batch)


def subprocess_environment() -> dict:
    """The environment for a child Python: no TIERFLOW_* settings but those the Makefile sets for the suite."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_") or k in KEPT_ENVIRONMENT}


# ---- tasks -------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    losses: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    report: Optional[dict] = None
    meter_peak: int = 0
    masters: dict = field(default_factory=dict)   # fp32 masters of 16-bit parameters, by state_dict name
    nvme_adam: dict = field(default_factory=dict)  # the NVMe optimizer's statistics, when it ran
    gpu_share: int = 0                             # parameters stepped on the GPU (Deep Optimizer States)
    host_in_use_after_release: int = -1            # pinned pool bytes in use once model and optimizer are gone
    session: Optional[object] = None                # tierflow's session, kept alive by this Run for inspection


@dataclass
class Task:
    """A model factory, a batch factory and a loss. Factories build on the CPU; `model_on`/`batch_on` move.

    key: what makes the task, when its factory says it (gpt_task, encoder_task, cnn_task): `train` runs the
    baseline of a keyed task once per process for each set of its arguments (the factories' code and the torch
    settings a run reads among them) and hands out copies, leaving torch's random state as the run would."""
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    key: Optional[tuple] = None

    def model_on(self, device: str, dtype: torch.dtype = torch.float32) -> nn.Module:
        """A fresh model (from the current torch seed) on `device` in `dtype`."""
        return self.make_model().to(device=torch_device(device), dtype=dtype)

    def batch_on(self, i: int, device: str, dtype: torch.dtype = torch.float32) -> tuple:
        """Batch `i`, the same data on every device."""
        return to_device(self.make_batch(i), device, dtype)


def gpt_task(layers: int = 2, width: int = 64, block: int = 64, batch: int = 8, dropout: float = 0.1) -> Task:
    data = CharData(make_text(600), block)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=block, n_layer=layers, n_head=4,
                    n_embd=width, dropout=dropout)

    def batch_fn(i: int) -> tuple:
        return data.batch(batch, torch.Generator().manual_seed(1000 + i))

    return Task(lambda: GPT(cfg), batch_fn, lambda m, b: gpt_loss(m, *b),
                key=("gpt", layers, width, block, batch, dropout))


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

    return Task(make, batch_fn, loss, key=("encoder",))


def cnn_task() -> Task:
    def make():
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
            nn.Flatten(), nn.Linear(32 * 16, 10))

    def batch_fn(i: int) -> tuple:
        g = torch.Generator().manual_seed(3000 + i)
        return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)

    return Task(make, batch_fn, lambda m, b: F.cross_entropy(m(b[0]), b[1]), key=("cnn",))


# ---- the baseline's optimizer for 16-bit models ------------------------------------------------------------------


class Fp32MasterAdamW:
    """Plain PyTorch with tierflow's CPU-optimizer arithmetic for 16-bit models.

    ``torch.optim.AdamW`` steps fp32 copies (masters) of the 16-bit parameters
    on the same device, from the 16-bit gradients widened to fp32, and each
    parameter becomes its master rounded to nearest (what CPUAdamW does, see
    test_16_bit_params_step_an_fp32_master). Torch's AdamW on the 16-bit
    parameters themselves keeps 16-bit moments and rounds every update, which
    is a different algorithm, not a different rounding.
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **hyper) -> None:
        self.params = [p for p in params]
        self.masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in self.params]
        self.inner = optimizer_cls(self.masters, **hyper)
        self.param_groups = self.inner.param_groups

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


# ---- training ----------------------------------------------------------------------------------------------------


def train(task: Task, steps: int, use_tierflow: bool, *, device: str = "emulated", dtype: torch.dtype = torch.float32,
          accumulate: int = 1, lr: float = 1e-3, weight_decay: float = 0.01, optimizer_cls=torch.optim.AdamW,
          scheduler=None, clip_grad_norm: Optional[float] = None, fp32_masters: bool = False,
          after_step: Optional[Callable[[int], None]] = None,
          before_step: Optional[Callable[[torch.nn.Module], None]] = None, **settings) -> Run:
    """`steps` optimizer steps of `accumulate` backward passes each, on `device` in `dtype`.

    clip_grad_norm: torch.nn.utils.clip_grad_norm_ after the last backward of each step (the user's clip).
    fp32_masters: the baseline steps fp32 masters of 16-bit parameters (Fp32MasterAdamW).
    after_step: called with the step's index after each optimizer step (the user's own work between steps).
    before_step: called with the model after the clip, before each optimizer step (the user's own edits of the
    gradients: p.grad.data.clamp_(), a hand-written all-reduce).
    settings: tierflow.wrap's keyword arguments (only with use_tierflow).
    """
    if settings and not use_tierflow:
        raise TypeError(f"train: tierflow settings {sorted(settings)} given for a run without tierflow")
    if fp32_masters and use_tierflow:
        raise TypeError("train: fp32_masters describes the baseline; tierflow's CPU optimizer always keeps them")
    # The baseline of a keyed task, once per process (tests/README.md): everything it depends on is in the key; a
    # run with a callback of the test's (a scheduler, after_step) is its own.
    # On the emulated device only: a CUDA run keeps nothing on the GPU past its test.
    cache_key = None
    if not use_tierflow and task.key is not None and scheduler is None and after_step is None and \
            before_step is None and device != "cuda":
        cache_key = (task.key, task.make_model.__code__, task.make_batch.__code__, task.loss.__code__, steps, device,
                     dtype, accumulate, lr, weight_decay, optimizer_cls, clip_grad_norm, fp32_masters,
                     torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                     torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu"))
        if cache_key in _BASELINES:
            cached, rng = _BASELINES[cache_key]
            torch.set_rng_state(rng)  # where the run would have left it
            return _copy_of(cached)
    if device == "cuda":
        # What earlier runs left for the garbage collector (a wrapped model's cycles) still holds device memory,
        # which a run's measured peak (the plan's fixed bytes) would count: a budget taken from one run must
        # hold for the next.
        gc.collect()
    torch.manual_seed(0)
    model = task.model_on(device, dtype)
    hyper = dict(lr=lr, weight_decay=weight_decay)
    opt = Fp32MasterAdamW(model.parameters(), optimizer_cls, **hyper) if fp32_masters else \
        optimizer_cls(model.parameters(), **hyper)
    meter = None
    if use_tierflow:
        model, opt = tierflow.wrap(model, opt, device=device, **settings)
    else:
        meter = tierflow.SavedActivationMeter()
    sched = scheduler(opt) if scheduler else None
    run = Run()
    for step in range(steps):
        total = 0.0
        for micro in range(accumulate):
            batch = task.batch_on(step * accumulate + micro, device, dtype)
            if meter is not None:
                meter.begin_forward()
                with meter.hooks():
                    loss = task.loss(model, batch)
            else:
                loss = task.loss(model, batch)
            (loss / accumulate).backward()
            total += loss.item()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if before_step is not None:
            before_step(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched:
            sched.step()
        run.losses.append(total)
        if after_step is not None:
            after_step(step)
    run.params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): k for k, p in model.named_parameters()}
    if use_tierflow:
        run.report = tierflow.report()
        assert run.report["device"] == device, f"tierflow ran on {run.report['device']}, not on {device}"
        session = run.session = tierflow.current_session()
        if isinstance(opt, tierflow.CPUAdamW):
            run.nvme_adam = dict(session.runtime.nvme_adam_stats())
            run.gpu_share = len(opt._gpu_share or ())
        if isinstance(opt, tierflow.CPUAdamW) and dtype != torch.float32:
            state = opt.state_dict()["state"]  # reads NVMe-resident states back
            params = [p for g in opt.param_groups for p in g["params"]]
            for i, s in state.items():
                if "master" in s:
                    run.masters[names[id(params[i])]] = s["master"].detach().to(torch.float32).clone()
    elif fp32_masters:
        run.masters = {names[id(p)]: m.detach().clone() for p, m in zip(opt.params, opt.masters)
                       if p.dtype != torch.float32}
    if use_tierflow:
        # Everything the run held is gone once the model and optimizer are: the pool must be empty again.
        del model, opt, sched
        gc.collect()
        run.host_in_use_after_release = session.runtime.stats()["host_pool"]["in_use"]["current"]
    else:
        run.meter_peak = meter.peak_bytes
    if cache_key is not None:
        _BASELINES[cache_key] = (_copy_of(run), torch.get_rng_state())
    return run


_BASELINES: dict = {}


def _copy_of(run: Run) -> Run:
    """A baseline's copy a test may change (its tensors cloned)."""
    return Run(losses=list(run.losses), params={k: v.clone() for k, v in run.params.items()},
               masters={k: v.clone() for k, v in run.masters.items()}, meter_peak=run.meter_peak)


# ---- comparisons -------------------------------------------------------------------------------------------------


def assert_bit_identical(a: Run, b: Run) -> None:
    assert a.losses == b.losses, f"losses differ: {a.losses} vs {b.losses}"
    for k in a.params:
        # Parameters offloaded to the host (offload_params) are read there: compared on the host, bit for bit.
        assert torch.equal(a.params[k].cpu(), b.params[k].cpu()), f"parameter {k} differs"


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
