"""Gradients streamed to the CPU optimizer in buckets during backward (Note [Gradient streaming]).

Every comparison is against a run that does not stream: the same task, seed and data, either
plain torch (element-wise at the CPU kernel's 1e-6, see harness.assert_close) or tierflow with
TIERFLOW_OVERLAP_STEP=off, which runs the same kernel on the same gradient values after backward
and must therefore agree bit for bit. The Makefile runs this file on the polite and on the
adversarial emulated device; on the adversarial one every gradient copy, CPU step and weight copy
completes late and out of order, so a missing wait shows up as NaN.
"""

import math

import pytest
import torch

import tierflow
from harness import assert_bit_identical, assert_close, gpt_task, train

SMALL = "4KiB"  # the smallest bucket: many buckets even for the small test GPT


def grad_bytes(task, device, dtype=torch.float32):
    """Bytes of one step's gradients: what each step must move device -> host exactly once."""
    torch.manual_seed(0)
    return sum(p.numel() * p.element_size() for p in task.model_on(device, dtype).parameters())


@pytest.mark.parametrize("bucket", [SMALL, "64KiB", "auto"])
def test_streamed_steps_equal_steps_after_backward(bucket, device):
    task = gpt_task(dropout=0.0)
    streamed = train(task, 4, True, device=device, grad_bucket_bytes=bucket)
    after = train(task, 4, True, device=device, overlap_step="off")
    assert_bit_identical(streamed, after)  # the same kernel on the same landed gradients
    s = streamed.report["optimizer"]["streaming"]
    assert s["committed"] == s["early_steps"] > 0 and s["redone"] == 0 and s["taken_back"] == 0
    assert s["grad_bytes_to_host"] == 4 * grad_bytes(task, device), "each gradient crosses once per step"
    assert s["weight_bytes_to_device"] == s["grad_bytes_to_host"]
    if bucket == SMALL:
        assert s["bucket_count"] > 4 and s["buckets"] >= 4 * s["bucket_count"] - 4
    assert streamed.host_in_use_after_release == 0


def test_streaming_equals_plain_torch(device):
    task = gpt_task()
    assert_close(train(task, 4, False, device=device), train(task, 4, True, device=device, grad_bucket_bytes=SMALL))


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_max_grad_norm_under_streaming_equals_clip_grad_norm_then_adamw(max_norm, device):
    """The clip coefficient comes from clip_grad_norm_'s own ops; a binding clip redoes from the landed gradients."""
    task = gpt_task(dropout=0.0)
    base = train(task, 4, False, device=device, clip_grad_norm=max_norm)
    tier = train(task, 4, True, device=device, max_grad_norm=max_norm, grad_bucket_bytes=SMALL)
    assert_close(base, tier)
    # Bit for bit what tierflow computes with the user's own clip and no overlap.
    assert_bit_identical(tier, train(task, 4, True, device=device, clip_grad_norm=max_norm, overlap_step="off"))
    s = tier.report["optimizer"]["streaming"]
    if max_norm < 1:
        # The running norm over the landed buckets proved the clip binds: speculation stopped early.
        torch.manual_seed(0)
        n_params = len(list(task.model_on(device).parameters()))
        assert s["speculation_stops"] == 4 and s["committed"] == 0
        assert s["early_steps"] < 4 * n_params, "buckets after the bound was crossed did not step ahead"
        assert s["step_kernel_ms"] > 0  # step() stepped from the landed gradients
    else:
        assert s["speculation_stops"] == 0 and s["redone"] == 0 and s["committed"] == s["early_steps"] > 0


def _poison_during_backward(model, at_step):
    """A hook that puts an inf into one gradient while backward runs, at optimizer step `at_step`."""
    state = {"step": 0}
    p = list(model.parameters())[3]

    def hook(g):
        if state["step"] == at_step:
            g = g.clone()
            g.view(-1)[0] = float("inf")
        return g

    p.register_hook(hook)
    return state


def _train_with_poison(task, device, steps, use_tierflow, **settings):
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if use_tierflow:
        model, opt = tierflow.wrap(model, opt, device=device, **settings)
    state = _poison_during_backward(model, 1)
    losses = []
    for step in range(steps):
        state["step"] = step
        loss = task.loss(model, task.batch_on(step, device))
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        if use_tierflow or finite:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


def test_skip_nonfinite_seen_in_a_landed_bucket_skips_exactly(device):
    task = gpt_task(dropout=0.0)
    base_losses, base_params, _ = _train_with_poison(task, device, 4, False)
    losses, params, opt = _train_with_poison(task, device, 4, True, skip_nonfinite="on", grad_bucket_bytes=SMALL)
    for a, b in zip(base_losses, losses):
        assert abs(a - b) <= 1e-6 * abs(a), (base_losses, losses)
    for k in base_params:
        torch.testing.assert_close(params[k], base_params[k], rtol=1e-6, atol=5e-5, msg=k)
        assert torch.isfinite(params[k]).all(), k
    assert opt.overlap_stats["skipped_steps"] == 1
    assert opt.stream_stats()["speculation_stops"] >= 1, "the inf was seen on the host before backward ended"


def test_nonfinite_gradient_with_clipping_matches_torch(device):
    """An inf gradient under max_grad_norm: torch's clip turns everything NaN; so does tierflow, identically."""
    task = gpt_task(dropout=0.0)
    torch.manual_seed(0)

    def run(use_tierflow):
        torch.manual_seed(0)
        model = task.model_on(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if use_tierflow:
            model, opt = tierflow.wrap(model, opt, device=device, max_grad_norm=1.0, grad_bucket_bytes=SMALL)
        state = _poison_during_backward(model, 1)
        for step in range(2):
            state["step"] = step
            task.loss(model, task.batch_on(step, device)).backward()
            if not use_tierflow:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    base, tier = run(False), run(True)
    for k in base:
        torch.testing.assert_close(tier[k], base[k], rtol=1e-6, atol=5e-5, equal_nan=True, msg=k)


@pytest.mark.parametrize("hint", [1, 3])
def test_only_the_last_micro_batch_streams(hint, device):
    task = gpt_task(dropout=0.0)
    base = train(task, 3, False, device=device, accumulate=3)
    tier = train(task, 3, True, device=device, accumulate=3, grad_accumulation_steps=hint, grad_bucket_bytes=SMALL)
    assert_close(base, tier)
    s = tier.report["optimizer"]["streaming"]
    if hint == 3:
        # One crossing per step, not one per micro-batch; every early step kept.
        assert s["grad_bytes_to_host"] == 3 * grad_bytes(task, device)
        assert s["committed"] > 0 and s["taken_back"] == 0
    else:
        assert s["taken_back"] > 0  # a wrong hint costs redone work, not correctness


def test_lr_scheduler_changes_are_seen_by_the_next_backward(device):
    task = gpt_task(dropout=0.0)

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    base = train(task, 4, False, device=device, scheduler=sched)
    tier = train(task, 4, True, device=device, scheduler=sched, grad_bucket_bytes=SMALL)
    assert_close(base, tier)
    s = tier.report["optimizer"]["streaming"]
    # The hyperparameters are read when each backward begins: no step is redone for a new lr.
    assert s["redone"] == 0 and s["committed"] == s["early_steps"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gradients_stream_and_match(dtype, device):
    task = gpt_task(dropout=0.0)
    streamed = train(task, 3, True, device=device, dtype=dtype, grad_bucket_bytes=SMALL)
    after = train(task, 3, True, device=device, dtype=dtype, overlap_step="off")
    assert_bit_identical(streamed, after)
    assert streamed.masters.keys() == after.masters.keys()
    for k in after.masters:
        assert torch.equal(streamed.masters[k], after.masters[k]), k
    s = streamed.report["optimizer"]["streaming"]
    assert s["grad_bytes_to_host"] == 3 * grad_bytes(task, device, dtype), "16-bit gradients cross in 16 bits"


def test_weights_return_during_the_next_forward(device):
    """TIERFLOW_WEIGHTS_RETURN=forward: each module waits for its own weights; results do not change."""
    task = gpt_task(dropout=0.0)
    forward = train(task, 4, True, device=device, weights_return="forward", grad_bucket_bytes=SMALL)
    at_step = train(task, 4, True, device=device, weights_return="step", grad_bucket_bytes=SMALL)
    assert_bit_identical(forward, at_step)
    assert forward.report["optimizer"]["streaming"]["weight_bytes_to_device"] > 0
    assert forward.host_in_use_after_release == 0


def test_weights_in_flight_are_waited_for_by_synchronize_and_state_dicts(device):
    task = gpt_task(dropout=0.0)
    torch.manual_seed(0)
    model = task.model_on(device)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device=device,
                               weights_return="forward", grad_bucket_bytes=SMALL)
    for i in range(2):
        task.loss(model, task.batch_on(i, device)).backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()  # waits for every weight still on its way
    opt.synchronize()
    for k, p in model.named_parameters():
        assert torch.equal(sd[k], p.detach()), k
        master = opt.state[p]["master"]
        assert torch.equal(p.detach(), master.to(p.dtype)), f"{k} is its master after the copies landed"
        assert math.isfinite(float(p.detach().abs().sum())), k
