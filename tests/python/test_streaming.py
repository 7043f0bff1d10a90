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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_the_users_clip_grad_norm_is_picked_up(max_norm, dtype, device):
    """Note [Clip picked up]: the user's own clip_grad_norm_ between backward and step() keeps the early steps
    (committed when it does not bind, stepped from the landed gradients with its coefficient when it does), bit for
    bit the steps taken from p.grad after backward. Before, every early step was fetched and stepped again."""
    task = gpt_task(dropout=0.0)
    picked = train(task, 4, True, device=device, dtype=dtype, clip_grad_norm=max_norm, grad_bucket_bytes=SMALL)
    assert_bit_identical(picked, train(task, 4, True, device=device, dtype=dtype, clip_grad_norm=max_norm,
                                       overlap_step="off"))
    s = picked.report["optimizer"]["streaming"]
    if max_norm > 1:  # a coefficient of exactly 1: every early step stands, in every dtype
        assert s["clips_picked_up"] > 0 and s["redone"] == 0 and s["committed"] == s["early_steps"] > 0, s
    else:
        # The max_norm seen at the first step stops speculation from the second on, once the clip must bind.
        assert s["speculation_stops"] == 3 and s["committed"] == 0, s
        # The kernel's fp32 multiply rounds as torch's only for fp32 gradients: bf16 ones step from p.grad.
        assert (s["clips_picked_up"] > 0) == (dtype == torch.float32), s


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


@pytest.mark.parametrize("weights_return", ["step", "forward"])
def test_a_forward_on_another_stream_reads_the_new_weights(weights_return, device):
    """Forward and backward under torch.cuda.stream(s), step() on the default stream, and s never waits for the
    default stream after the first step (with torch's own optimizer that would race its update kernels): the
    weights' copies are waited for by s itself (the model's forward pre-hook with =step, each module's with
    =forward), so the run is bit for bit the one on the default stream."""
    if device != "cuda":
        pytest.skip("a forward on a second CUDA stream needs a GPU: the emulated device's compute is one stream "
                    "(Note [Adversarial emulated device])")
    task = gpt_task(dropout=0.0)

    def run(side: bool) -> list:
        torch.manual_seed(0)
        model = task.model_on(device)
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device=device,
                                   weights_return=weights_return, grad_bucket_bytes=SMALL)
        stream = torch.cuda.Stream()
        batches = [task.batch_on(i, device) for i in range(4)]
        stream.wait_stream(torch.cuda.current_stream())  # the batches and weights, made on the default stream
        losses = []
        for batch in batches:
            if side:
                with torch.cuda.stream(stream):
                    loss = task.loss(model, batch)
                    loss.backward()
                torch.cuda.current_stream().wait_stream(stream)
            else:
                loss = task.loss(model, batch)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        # With weights_return="forward" the last step's weights arrive at the next forward, which never comes:
        # parameters read any other way wait for them first (docs/python.md). Failed on an H200 without it.
        opt.synchronize()
        return losses + [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


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
        # The master is on the host: compared there (on CUDA, torch.equal across devices raises).
        assert torch.equal(p.detach().cpu(), master.to(p.dtype)), f"{k} is its master after the copies landed"
        assert math.isfinite(float(p.detach().abs().sum())), k


# ---- TIERFLOW_OFFLOAD_GRADIENTS: device gradients freed once their copy is done --------------------------------


def _n_params(task, device):
    torch.manual_seed(0)
    return len(list(task.model_on(device).parameters()))


@pytest.mark.parametrize("bucket", [SMALL, "auto"])
def test_offloaded_gradients_are_freed_after_their_copy_and_steps_match(bucket, device):
    """Each gradient's device memory goes as soon as its copy has landed; the steps are those taken
    after backward, bit for bit (on the adversarial device a gradient freed before its copy read it
    is poison, and the step would differ)."""
    task = gpt_task(dropout=0.0)
    offloaded = train(task, 4, True, device=device, grad_bucket_bytes=bucket, offload_gradients="on")
    after = train(task, 4, True, device=device, overlap_step="off")
    assert_bit_identical(offloaded, after)
    s = offloaded.report["optimizer"]["streaming"]
    assert s["grads_released"] == 4 * _n_params(task, device)
    # Nothing else held them: every released gradient's device memory was freed.
    assert s["grad_bytes_freed"] == s["grad_bytes_to_host"] == 4 * grad_bytes(task, device)
    assert s["grads_restored"] == 0 and s["committed"] == s["early_steps"] > 0 and s["taken_back"] == 0
    assert offloaded.host_in_use_after_release == 0


def test_offloaded_gradients_leave_p_grad_none_and_free_device_memory(device):
    """After backward p.grad is None for every streamed parameter, and once the buckets have landed
    (before step()) every gradient's device memory is freed; on CUDA the allocator then holds one
    step's gradients less than with the option off."""
    task = gpt_task(dropout=0.0)

    def after_backward(offload):
        torch.manual_seed(0)
        model = task.model_on(device)
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device,
                                   grad_bucket_bytes=SMALL, offload_gradients=offload)
        task.loss(model, task.batch_on(0, device)).backward()
        grads = [p.grad for p in model.parameters()]
        opt._stream.wait_worker()  # every bucket has landed on the host
        freed = opt.stream_stats()["grad_bytes_freed"]
        allocated = None
        if device == "cuda":
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
        opt.step()
        opt.zero_grad()
        return grads, freed, allocated

    grads_on, freed_on, mem_on = after_backward("on")
    grads_off, freed_off, mem_off = after_backward("off")
    assert all(g is None for g in grads_on), "p.grad is None until step() with TIERFLOW_OFFLOAD_GRADIENTS=on"
    assert all(g is not None for g in grads_off)
    assert freed_on == grad_bytes(task, device) and freed_off == 0
    if device == "cuda":
        # The worker dropped the last references once the copies landed.
        assert mem_off - mem_on >= 0.9 * grad_bytes(task, device), (mem_off, mem_on)


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_offloaded_gradients_clip_as_clip_grad_norm_(max_norm, device):
    """The global norm comes from the per-tensor norms the hook took before freeing each gradient."""
    task = gpt_task(dropout=0.0)
    tier = train(task, 4, True, device=device, max_grad_norm=max_norm, grad_bucket_bytes=SMALL,
                 offload_gradients="on")
    assert_bit_identical(tier, train(task, 4, True, device=device, clip_grad_norm=max_norm, overlap_step="off"))
    assert_close(train(task, 4, False, device=device, clip_grad_norm=max_norm), tier)
    s = tier.report["optimizer"]["streaming"]
    assert s["grads_released"] > 0 and s["grads_restored"] == 0
    if max_norm < 1:
        assert s["speculation_stops"] == 4 and s["committed"] == 0


def test_offloaded_gradients_with_a_nonfinite_step_skip_it_and_give_p_grad_back(device):
    task = gpt_task(dropout=0.0)
    base_losses, base_params, _ = _train_with_poison(task, device, 4, False)
    losses, params, opt = _train_with_poison(task, device, 4, True, skip_nonfinite="on", grad_bucket_bytes=SMALL,
                                             offload_gradients="on")
    for a, b in zip(base_losses, losses):
        assert abs(a - b) <= 1e-6 * abs(a), (base_losses, losses)
    for k in base_params:
        torch.testing.assert_close(params[k], base_params[k], rtol=1e-6, atol=5e-5, msg=k)
    assert opt.overlap_stats["skipped_steps"] == 1
    # A skipped step leaves the gradients in p.grad, as torch's optimizers do.
    assert opt.stream_stats()["grads_restored"] == _n_params(task, device)


@pytest.mark.parametrize("hint", [1, 3])
def test_offloaded_gradients_under_accumulation(hint, device):
    """A wrong hint (1 for 3 micro-batches) streams and frees too early: the next forward puts the
    gradients back and backward accumulates into them, so the result does not change."""
    task = gpt_task(dropout=0.0)
    tier = train(task, 3, True, device=device, accumulate=3, grad_accumulation_steps=hint, grad_bucket_bytes=SMALL,
                 offload_gradients="on")
    assert_bit_identical(tier, train(task, 3, True, device=device, accumulate=3, overlap_step="off"))
    s = tier.report["optimizer"]["streaming"]
    if hint == 3:
        assert s["grads_restored"] == 0 and s["grad_bytes_to_host"] == 3 * grad_bytes(task, device)
    else:
        assert s["grads_restored"] > 0 and s["taken_back"] > 0


def test_offloaded_gradients_survive_load_state_dict_before_step(device):
    """model.load_state_dict or optimizer.load_state_dict between backward and step(): the step still
    takes this backward's gradients (they come back from the host)."""
    task = gpt_task(dropout=0.0)

    def run(**settings):
        torch.manual_seed(0)
        model = task.model_on(device)
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device=device,
                                   **settings)
        for i in range(3):
            task.loss(model, task.batch_on(i, device)).backward()
            if i == 1:
                model.load_state_dict(model.state_dict())
            if i == 2:
                opt.load_state_dict(opt.state_dict())
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt

    after, _ = run(overlap_step="off")
    offloaded, opt = run(offload_gradients="on", grad_bucket_bytes=SMALL)
    for k in after:
        assert torch.equal(offloaded[k], after[k]), k
    assert opt.stream_stats()["grads_restored"] == 2 * _n_params(task, device)


def test_offloaded_gradients_need_the_stream(device):
    task = gpt_task()
    torch.manual_seed(0)
    model = task.model_on(device)
    with pytest.raises(tierflow.ConfigError, match="TIERFLOW_OFFLOAD_GRADIENTS=on.*TIERFLOW_OVERLAP_STEP=on"):
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device=device, overlap_step="off",
                      offload_gradients="on")


def test_auto_buckets_are_sized_from_the_measured_step(device):
    """At a steady step (Note [Steady step]; at the latest the STEADY_STEP_LIMIT-th streamed one), auto buckets
    follow the measured backward, CPU AdamW rate and link."""
    task = gpt_task(dropout=0.0)
    s = train(task, tierflow._C.STEADY_STEP_LIMIT, True, device=device).report["optimizer"]["streaming"]
    assert s["sized_link_bytes_per_s"] > 0 and s["sized_cpu_grad_bytes_per_s"] > 0 and s["sized_backward_ms"] > 0
    assert s["bucket_bytes"] == tierflow._C.measured_grad_bucket_bytes(
        s["sized_backward_ms"] / 1e3, s["sized_link_bytes_per_s"], s["sized_cpu_grad_bytes_per_s"],
        grad_bytes(task, device))
    fixed = train(task, 3, True, device=device, grad_bucket_bytes="64KiB").report["optimizer"]["streaming"]
    assert fixed["bucket_bytes"] == 64 << 10 and fixed["sized_link_bytes_per_s"] == 0, "an explicit size stands"


def test_a_window_is_seen_as_streamed_and_growing_the_pool_only_when_it_did(device):
    """Note [Steady step]'s inputs, per window: whether the CPU AdamW stepped streamed gradients in it, and whether
    it allocated pinned slabs (the first step does: the optimizer states)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device=device, grad_bucket_bytes=SMALL)
    streaming = opt._streaming
    assert streaming.window_seen()[0] is False, "nothing streamed before the first backward"
    model(torch.randn(8, 32)).sum().backward()
    streaming.stream.wait_worker()  # as step() does before it asks
    streamed, backward_ms, grew = streaming.window_seen()
    assert streamed and backward_ms > 0 and grew, "the first window streamed and made the optimizer states"
    assert streaming.window_seen()[0] is False and streaming.window_seen()[2] is False, "nothing since"
    opt.zero_grad()
    tierflow.unwrap(model)


class _FakePlanner:
    forced = False
    plan = None
    settled = None

    def settle(self, why):
        self.settled = why


def test_the_gpu_share_waits_for_the_activation_plan_in_force(device):
    """Note [Steady step]: under the activation planner the share is chosen only once a plan is in force (its
    timed step must measure the peak without the share, or with it, never half): before, steady steps do not
    count; after, it decides at a steady step."""
    import weakref

    from tierflow.optim.gpu_share import GpuShare

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device=device)
    share, planner = GpuShare("auto"), _FakePlanner()
    share.planner = weakref.ref(planner)
    steady = (True, 10.0, False)
    for _ in range(tierflow._C.STEADY_STEP_LIMIT + 1):
        assert share.choose(opt.param_groups, opt._runtime, opt._streaming, opt.state, steady) is False
    assert share.auto, "no plan in force: still waiting, nothing counted"
    planner.plan = {"predicted_device_peak_bytes": 1 << 20}
    assert share.choose(opt.param_groups, opt._runtime, opt._streaming, opt.state, steady) is False
    assert share.auto, "the first streamed step it sees is not steady"
    assert share.choose(opt.param_groups, opt._runtime, opt._streaming, opt.state, steady) is False
    assert not share.auto and share.fraction == 0.0, "decided (no CUDA parameter here: none moves)"
    assert planner.settled is None, "nothing moved: the plan may still change"
    tierflow.unwrap(model)


def test_the_last_window_timeline_orders_every_bucket(device):
    """Note [Stream timeline]: per bucket of the last step, launched <= picked <= landed <= stepped, all before
    step()'s wait ended; every bucket of the plan once, with all of the step's gradient bytes."""
    task = gpt_task(dropout=0.0)
    s = train(task, 3, True, device=device, grad_bucket_bytes=SMALL).report["optimizer"]["streaming"]
    w = s["last_window"]
    buckets = w["buckets"]
    assert len(buckets) == s["bucket_count"] > 4
    assert sorted(b["bucket"] for b in buckets) == list(range(s["bucket_count"]))
    assert sum(b["grad_bytes"] for b in buckets) == grad_bytes(task, device)
    for b in buckets:
        assert 0 <= b["launched_ms"] <= b["picked_ms"] <= b["landed_ms"] <= b["stepped_ms"] <= w["worker_done_ms"], b
    assert 0 <= w["backward_end_ms"] <= w["step_ms"] <= w["worker_done_ms"]
    picked = [b["picked_ms"] for b in buckets]
    assert picked == sorted(picked), "one worker: buckets are taken in the order they went to it"


class _ManyParameters(torch.nn.Module):
    """16 parameters of one module and 16 in a ParameterList (which has no forward of its own):
    with TIERFLOW_WEIGHTS_RETURN=forward, this module's forward must wait for all 32."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        for i in range(16):
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(width) * 0.1))
        self.listed = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(width) * 0.1) for _ in range(16)])
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for i in range(16):
            x = torch.tanh(x * (1 + getattr(self, f"w{i}")))
        for p in self.listed:
            x = torch.tanh(x + p)
        return self.head(x)


def test_weights_return_in_forward_waits_for_every_weight_a_forward_reads(device):
    def run(weights_return):
        torch.manual_seed(0)
        model = _ManyParameters().to(torch.device("cuda") if device == "cuda" else "cpu")
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device=device,
                                   weights_return=weights_return, grad_bucket_bytes=SMALL)
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(6):
            x = torch.randn(64, 32, generator=g).to(next(model.parameters()).device)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    assert run("forward") == run("step")


def test_offloaded_gradients_refuse_grad_scaler(device):
    """GradScaler reads p.grad, which offloaded gradients leave None: step() refuses, names what is
    accepted, and leaves the optimizer usable (the same gradients then step without the scaler)."""
    task = gpt_task(dropout=0.0)
    torch.manual_seed(0)
    model = task.model_on(device)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device,
                               offload_gradients="on")
    scaler = torch.amp.GradScaler("cuda" if device == "cuda" else "cpu")
    scaler.scale(task.loss(model, task.batch_on(0, device))).backward()
    with pytest.raises(tierflow.TierflowError, match="GradScaler.*TIERFLOW_OFFLOAD_GRADIENTS.*accepted: bf16"):
        scaler.step(opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.step()  # no scaler: steps (the scaled gradients) instead of refusing again
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_failed_gradient_copy_loses_nothing(device):
    """A device -> host gradient copy that fails during backward: step() raises the copy's error, every
    gradient is back in p.grad with its value, no parameter moved, and the next step() is the step."""
    if device == "cuda":
        pytest.skip("CopyFaults drives the emulated copy engine; a CUDA copy cannot be made to fail")
    task = gpt_task(dropout=0.0)

    def run(offload, faults=None):
        torch.manual_seed(0)
        model = task.model_on(device)
        # Activations stay: the only copies to the host during backward are the gradients'.
        settings = dict(offload_gradients="on", grad_bucket_bytes=SMALL, _copy_faults=faults) if offload \
            else dict(overlap_step="off")
        settings["offload_activations"] = "none"
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device=device, **settings)
        task.loss(model, task.batch_on(0, device)).backward()
        opt.step()
        opt.zero_grad()
        after_first = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if faults is not None:
            faults.fail_d2h_copies = 1
        task.loss(model, task.batch_on(1, device)).backward()
        if faults is not None:
            with pytest.raises(tierflow._C.IOError, match="fail_d2h_copies"):
                opt.step()
            for k, v in model.state_dict().items():
                assert torch.equal(v, after_first[k]), f"{k} moved in a step that failed"
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        return grads, {k: v.detach().clone() for k, v in model.state_dict().items()}

    faults = tierflow._C.CopyFaults()
    grads, params = run(True, faults)
    ref_grads, ref_params = run(False)
    assert faults.fail_d2h_copies == 0, "the fault was used"
    for k in ref_grads:
        assert torch.equal(grads[k], ref_grads[k]), f"gradient {k} was lost or changed"
    for k in ref_params:
        assert torch.equal(params[k], ref_params[k]), k
