"""The offload matrix: where activations go x where the optimizer steps x overlap, plus clipping,
gradient accumulation and the GPU optimizer share, on every device, in fp32 and bf16, each run
against plain PyTorch on the same device with the same seed and data.

Every case also checks, from tierflow's report, that the path it names really ran and that
nothing stayed behind.
"""

import os

import pytest
import torch

from harness import Run, assert_bit_identical, assert_close, encoder_task, gpt_task, train

STEPS = 4
LR = 1e-3  # train()'s default; the bf16 bounds below are in units of it
# Offload every saved tensor, through a small prefetch window, so that every path runs.
AGGRESSIVE = dict(min_offload_bytes=0, prefetch_bytes="256KiB")
ACTIVATIONS = ("host", "nvme", "none")
# (offload_optimizer, overlap_step). Combinations that are one code path are one case:
# - "none" keeps the user's torch.optim.AdamW; overlap is a setting of tierflow's CPUAdamW, so it
#   changes nothing there.
# - "host" steps on the CPU during backward (overlap on) or in step() (off): two paths.
# - "nvme": CPUAdamW._setup turns overlap off when states live on NVMe (they stream through
#   pinned buffers in step()), so on and off are the same path.
OPTIMIZERS = [("none", None), ("host", "on"), ("host", "off"), ("nvme", None)]
OPTIMIZER_IDS = ["opt_none", "opt_host_overlap", "opt_host_no_overlap", "opt_nvme"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TASKS = {"gpt": gpt_task(), "encoder": encoder_task()}

_baselines: dict = {}


def baseline(task: str, device: str, dtype: torch.dtype, **kw) -> Run:
    """Plain PyTorch on `device`; deterministic, so computed once per configuration and shared."""
    key = (task, device, dtype, tuple(sorted(kw.items())))
    if key not in _baselines:
        _baselines[key] = train(TASKS[task], STEPS, False, device=device, dtype=dtype, **kw)
    return _baselines[key]


@pytest.fixture
def nvme_dir(tmp_path):
    """tmp_path, where it takes O_DIRECT files; else a folder in the build tree (tmpfs may refuse them)."""
    probe = tmp_path / "o_direct_probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT))
        os.unlink(probe)
        return str(tmp_path)
    except OSError:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        d = os.path.join(root, "build", "nvme-tests", f"{tmp_path.name}-{os.getpid()}")
        os.makedirs(d, exist_ok=True)
        return d


def settings(activations: str, optimizer: str, overlap, nvme_dir: str) -> dict:
    s = dict(AGGRESSIVE, offload_activations=activations, offload_optimizer=optimizer)
    if overlap is not None:
        s["overlap_step"] = overlap
    if "nvme" in (activations, optimizer):
        s.update(nvme_paths=nvme_dir, nvme_memory="128MiB")
    return s


def baseline_for(task: str, device: str, dtype: torch.dtype, optimizer: str, **kw) -> Run:
    """With the CPU optimizer, 16-bit models are compared with fp32-master AdamW (harness.Fp32MasterAdamW)."""
    masters = optimizer != "none" and dtype != torch.float32
    return baseline(task, device, dtype, fp32_masters=masters, **kw) if masters else \
        baseline(task, device, dtype, **kw)


# ---- comparisons -------------------------------------------------------------------------------------------------

# bf16 has 8 significant bits: neighbouring values are at most 2^-7 apart, relative.
BF16_SPACING = 2.0 ** -7


def assert_close_bf16(base: Run, tier: Run, steps: int = STEPS) -> None:
    """tierflow's CPU optimizer on a bf16 model against fp32-master AdamW on the same device.

    Both keep fp32 masters and round them to bf16; the masters agree to ~1 fp32 ulp per step
    (test_optimizer.py), so a parameter differs only where that ulp crosses a bf16 rounding
    boundary, and the forward passes then see a handful of neighbouring bf16 values.
    """
    # Before the first step the model and data are the same and activation offload is exact.
    assert base.losses[0] == tier.losses[0], (base.losses, tier.losses)
    for i, (x, y) in enumerate(zip(base.losses, tier.losses)):
        # The loss is a bf16 number: a few flipped parameters move it by at most one unit of its last place.
        assert abs(x - y) <= BF16_SPACING * abs(x), f"step {i}: loss {x} vs {y}"
    flipped = total = 0
    for k, a in base.params.items():
        b = tier.params[k]
        if not a.is_floating_point():
            assert torch.equal(a, b), k
            continue
        assert torch.isfinite(b).all(), f"{k}: non-finite values"
        diff = (a.float() - b.float()).abs()
        # Adam moves an element by about lr per step however its gradient is rounded, so even an
        # element whose gradient is pure rounding noise (attention key biases) stays within 2*lr*steps.
        assert diff.max() <= 2 * LR * steps, f"{k}: differs by {diff.max():.3g}"
        n = int((diff > 0).sum())
        # A 1-ulp fp32 wobble crosses a bf16 rounding boundary for ~2^-24/2^-8 of the elements per
        # step; noise-gradient directions flip more. A quarter of one tensor means a wrong step.
        assert n <= 0.25 * a.numel(), f"{k}: {n} of {a.numel()} elements differ"
        flipped, total = flipped + n, total + a.numel()
    # Over the whole model, well under 1% (0.1% measured); a step from a wrong gradient moves most elements.
    assert flipped <= 0.01 * total, f"{flipped} of {total} parameter elements differ"


def assert_matches(base: Run, tier: Run, optimizer: str, dtype: torch.dtype) -> None:
    if optimizer == "none":
        assert_bit_identical(base, tier)  # activation offload is an exact copy, and the optimizer is torch's
    elif dtype == torch.float32:
        assert_close(base, tier)  # CPU AdamW vs torch AdamW: 1e-6 relative (see harness.assert_close)
    else:
        assert_close_bf16(base, tier)


def assert_paths_ran(tier: Run, activations: str, optimizer: str, overlap) -> None:
    r = tier.report
    acts, nv = r["activations"], r["activations"]["nvme"]
    if activations == "none":
        assert acts["offloaded_blocks"] == 0 and acts["device_bytes"]["peak"] > 0, acts
    else:
        assert acts["offloaded_blocks"] > 0 and acts["unpacks"] > 0, acts
        assert r["links"]["gpu_to_host_bytes"] > 0 and r["links"]["host_to_gpu_bytes"] > 0, r["links"]
    if activations == "nvme":
        assert nv["writes"] > 0 and nv["reads"] + nv["forwarded"] > 0 and nv["write_failures"] == 0, nv
    else:
        assert nv["writes"] == 0, nv
    ov = r["optimizer"]["overlap"]
    if optimizer == "none":
        assert r["optimizer"]["steps"] == 0 and not tier.nvme_adam, "the user's optimizer stepped, not tierflow's"
    elif optimizer == "host":
        assert r["optimizer"]["steps"] >= STEPS and not tier.nvme_adam.get("steps"), r["optimizer"]
    else:
        s = tier.nvme_adam
        assert s["steps"] >= STEPS and s["bytes_read"] > 0 and s["bytes_written"] > 0 and s["write_failures"] == 0, s
    if overlap == "on":
        assert ov["early_steps"] > 0 and ov["committed"] == ov["early_steps"], ov
        assert ov["redone"] == 0 and ov["taken_back"] == 0, ov
    elif optimizer != "none":
        assert ov["early_steps"] == 0, ov


def assert_nothing_left(tier: Run, optimizer: str) -> None:
    r = tier.report
    assert r["activations"]["device_bytes"]["current"] == 0, "every saved block is released after backward"
    if optimizer == "none":
        assert r["host_pool"]["in_use"]["current"] == 0, "host blocks leaked"


# ---- the matrix --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activations", ACTIVATIONS, ids=[f"act_{a}" for a in ACTIVATIONS])
@pytest.mark.parametrize("optimizer,overlap", OPTIMIZERS, ids=OPTIMIZER_IDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gpt(dtype, optimizer, overlap, activations, device, nvme_dir):
    base = baseline_for("gpt", device, dtype, optimizer)
    tier = train(TASKS["gpt"], STEPS, True, device=device, dtype=dtype,
                 **settings(activations, optimizer, overlap, nvme_dir))
    assert_matches(base, tier, optimizer, dtype)
    assert_paths_ran(tier, activations, optimizer, overlap)
    assert_nothing_left(tier, optimizer)


@pytest.mark.parametrize("activations", ACTIVATIONS, ids=[f"act_{a}" for a in ACTIVATIONS])
@pytest.mark.parametrize("optimizer,overlap", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_encoder(optimizer, overlap, activations, device, nvme_dir):
    """nn.TransformerEncoder (torch's own attention and layer kernels), fp32."""
    base = baseline_for("encoder", device, torch.float32, optimizer)
    tier = train(TASKS["encoder"], STEPS, True, device=device, **settings(activations, optimizer, overlap, nvme_dir))
    assert_matches(base, tier, optimizer, torch.float32)
    assert_paths_ran(tier, activations, optimizer, overlap)
    assert_nothing_left(tier, optimizer)


CLIP = 0.05  # binds on every step of this model (its gradient norms are ~1)


@pytest.mark.parametrize("optimizer,overlap", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_gradient_clipping(optimizer, overlap, device, nvme_dir):
    """max_grad_norm=CLIP is clip_grad_norm_(CLIP) then step(); with the user's optimizer, the user clips."""
    base = baseline("gpt", device, torch.float32, clip_grad_norm=CLIP)
    assert base.losses[1:] != baseline("gpt", device, torch.float32).losses[1:], "the clip must bind"
    clip = dict(clip_grad_norm=CLIP) if optimizer == "none" else dict(max_grad_norm=CLIP)
    tier = train(TASKS["gpt"], STEPS, True, device=device, **clip, **settings("host", optimizer, overlap, nvme_dir))
    assert_matches(base, tier, optimizer, torch.float32)
    if overlap == "on":
        ov = tier.report["optimizer"]["overlap"]
        assert ov["committed"] == 0 and ov["redone"] == ov["early_steps"], "a binding clip redoes every early step"
        # The running norm of the landed gradient buckets proves the clip binds before backward ends, so
        # nothing more steps ahead, and step() steps from the gradients already on the host
        # (Note [Gradient streaming]).
        st = tier.report["optimizer"]["streaming"]
        assert st["speculation_stops"] == STEPS and st["step_kernel_ms"] > 0
    assert_nothing_left(tier, optimizer)


ACCUMULATE = 3


@pytest.mark.parametrize("optimizer,overlap", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_gradient_accumulation(optimizer, overlap, device, nvme_dir):
    """grad_accumulation_steps=N over N backward passes per step, as plain PyTorch accumulates."""
    base = baseline("gpt", device, torch.float32, accumulate=ACCUMULATE)
    tier = train(TASKS["gpt"], STEPS, True, device=device, accumulate=ACCUMULATE,
                 grad_accumulation_steps=ACCUMULATE, **settings("host", optimizer, overlap, nvme_dir))
    assert_matches(base, tier, optimizer, torch.float32)
    assert_paths_ran(tier, "host", optimizer, overlap)  # with the right hint, no early step is taken back
    assert_nothing_left(tier, optimizer)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gpu_optimizer_fraction(dtype, device):
    """gpu_optimizer_fraction=0.25: about a quarter of a CUDA model's parameters step on the GPU with
    a kernel that computes what the CPU kernel computes. The emulated device has no CUDA parameters,
    so there the setting must leave the CPU path exactly as it is (optim/gpu_share.py)."""
    share = train(TASKS["gpt"], STEPS, True, device=device, dtype=dtype, gpu_optimizer_fraction=0.25, **AGGRESSIVE)
    cpu = train(TASKS["gpt"], STEPS, True, device=device, dtype=dtype, gpu_optimizer_fraction=0, **AGGRESSIVE)
    n_params = sum(1 for _ in TASKS["gpt"].make_model().parameters())
    if device == "cuda":
        assert 0 < share.gpu_share < n_params, share.gpu_share
    else:
        assert share.gpu_share == 0, "no CUDA parameters: nothing steps on a GPU"
    assert_bit_identical(cpu, share)  # the same arithmetic wherever it runs
    assert_matches(baseline_for("gpt", device, dtype, "host"), share, "host", dtype)


@pytest.mark.parametrize("optimizer,overlap", [
    ("none", None), ("host", "off"), ("nvme", None),
    # CPUAdamW's post-accumulate-grad hooks reach it through a weak reference:
    # a bound method would make a cycle through autograd that gc cannot follow.
    ("host", "on"),
], ids=["opt_none", "opt_host_no_overlap", "opt_nvme", "opt_host_overlap"])
def test_pinned_memory_returns_once_model_and_optimizer_are_gone(optimizer, overlap, device, nvme_dir):
    tier = train(TASKS["gpt"], 2, True, device=device, **settings("host", optimizer, overlap, nvme_dir))
    assert tier.host_in_use_after_release == 0, f"{tier.host_in_use_after_release} pinned bytes still in use"
