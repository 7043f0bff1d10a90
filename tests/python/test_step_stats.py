"""tierflow.step_stats(): one entry per training step, its bytes per link the report's totals' differences, the CPU
step's exposure within step(); the transformers callback puts the figures in the logs the reporters receive (Note
[Step stats]). The arithmetic is tested in tests/cpp/test_step_stats.cpp; these check the marks and the counters."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import tierflow
from harness import torch_device
from tierflow._step_stats import step_stats

WIDTH, BLOCKS, BATCH = 64, 3, 16
LINKS = ("device_to_host_bytes", "host_to_device_bytes", "host_to_nvme_bytes", "nvme_to_host_bytes")
REPORT_LINKS = ("gpu_to_host_bytes", "host_to_gpu_bytes", "host_to_nvme_bytes", "nvme_to_host_bytes")


def tiny(device: str) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
                                  for _ in range(BLOCKS)], torch.nn.Linear(WIDTH, 1)).to(torch_device(device))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class TwoOutputs(torch.nn.Module):
    """A model whose two outputs both carry gradients: one backward all the same."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.body(x)
        return h, 2 * h


def batch(device: str, i: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(i)).to(torch_device(device))


def links() -> tuple:
    r = tierflow.report()["links"]
    return tuple(r[k] for k in REPORT_LINKS)


def test_one_entry_per_step_bytes_are_the_reports_differences(device):
    model, opt = tiny(device)
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations="host", min_offload_bytes=0)
    assert isinstance(opt, tierflow.CPUAdamW)
    moved, cpu_in_step = [], []
    for i in range(3):
        before, stream_before, python_before = links(), opt.stream_stats(), opt.python_step_ns
        model(batch(device, i)).square().mean().backward()
        opt.step()
        after, stream_after = links(), opt.stream_stats()
        opt.zero_grad()
        moved.append(tuple(a - b for a, b in zip(after, before)))
        # the stream's time inside step(): its wait for the worker and what it stepped again (Note [Stream timeline]),
        # and the Python path's (what the stream left)
        cpu_in_step.append(sum(stream_after[k] - stream_before[k] for k in ("step_wait_ms", "step_kernel_ms")) / 1e3
                           + (opt.python_step_ns - python_before) / 1e9)
    steps = step_stats()
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert step_stats(last=True) == steps[-1]
    peak_host = tierflow.report()["host_pool"]["in_use"]["peak"]
    for s, m, cpu in zip(steps, moved, cpu_in_step):
        assert tuple(s[k] for k in LINKS) == m, (s, m)
        assert s["exposed_cpu_step_s"] == pytest.approx(cpu, abs=1e-8), (s, cpu)
        assert s["device_to_host_bytes"] > 0 and s["host_to_device_bytes"] > 0, s  # activations went and came back
        assert (s["forwards"], s["backwards"]) == (1, 1)
        assert s["forward_s"] > 0 and s["backward_s"] > 0 and s["step_s"] > 0, s
        assert s["wall_s"] >= s["forward_s"] + s["backward_s"] + s["step_s"], s
        assert 0 <= s["exposed_cpu_step_s"] <= s["step_s"], s
        assert 0 <= s["exposed_copy_wait_s"] <= s["forward_s"] + s["backward_s"], s
        assert 0 < s["peak_pinned_host_bytes"] <= peak_host, s
    assert tierflow.report()["steps"]["recorded"] == 3


def test_nvme_links_are_the_reports_differences(device, nvme_dir):
    model, opt = tiny(device)
    model, opt = tierflow.wrap(model, opt, device=device, offload_optimizer="nvme", nvme_paths=nvme_dir,
                               nvme_memory="8MiB")  # the states go to NVMe and come back every step
    runtime = tierflow.current_session().runtime
    for i in range(3):
        before, states_before = links(), runtime.nvme_adam_stats()
        model(batch(device, i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        s, states = step_stats(last=True), runtime.nvme_adam_stats()
        assert tuple(s[k] for k in LINKS) == tuple(a - b for a, b in zip(links(), before))
        # only the optimizer's states use NVMe here: its own counters say the same (but of the first step, which
        # also writes the states it made)
        written, read = (states[k] - states_before[k] for k in ("bytes_written", "bytes_read"))
        assert i == 0 or (s["host_to_nvme_bytes"], s["nvme_to_host_bytes"]) == (written, read), (s, written, read)
        assert s["exposed_nvme_wait_s"] == pytest.approx((states["read_wait_ms"] - states_before["read_wait_ms"]) / 1e3,
                                                         abs=1e-8)
    # every NVMe read of these steps is the store's (its first step's writes include the states it made)
    assert sum(s["nvme_to_host_bytes"] for s in step_stats()) == runtime.nvme_adam_stats()["bytes_read"]
    s = step_stats(last=True)
    assert s["host_to_nvme_bytes"] > 0 and s["nvme_to_host_bytes"] > 0 and s["peak_nvme_bytes"] > 0, s
    assert 0 <= s["exposed_nvme_wait_s"] <= s["step_s"], s


def test_plain_optimizer_with_auto_activations(device):
    model, opt = tiny(device)
    model, opt = tierflow.wrap(TwoOutputs(model), opt, device=device, offload_optimizer="none",
                               offload_activations="auto")
    assert isinstance(opt, torch.optim.AdamW)
    for i in range(3):
        a, b = model(batch(device, i))
        (a.square().mean() + b.mean()).backward()
        opt.step()
        opt.zero_grad()
    steps = step_stats()
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["step_s"] > 0 and s["exposed_cpu_step_s"] == 0 and s["backwards"] == 1 for s in steps), steps


def test_without_an_optimizer_the_next_forward_ends_a_step(device):
    model, opt = tiny(device)
    model, _ = tierflow.wrap(model, device=device, offload_activations="host", min_offload_bytes=0)
    for i in range(3):
        model(batch(device, i)).square().mean().backward()
        opt.step()  # not known to tierflow: its step() is not marked
        opt.zero_grad()
    assert [s["step"] for s in step_stats()] == [1, 2], "the third step ends at the next forward"
    with torch.no_grad():
        model(batch(device, 9))  # an evaluation forward marks nothing
    assert len(step_stats()) == 2
    model(batch(device, 3)).square().mean().backward()
    assert [s["step"] for s in step_stats()] == [1, 2, 3]
    assert all(s["step_s"] == 0 and s["backward_s"] > 0 for s in step_stats())


def test_the_watched_optimizer_keeps_no_session_alive(device):
    model, opt = tiny(device)
    model, opt = tierflow.wrap(model, opt, device=device, offload_optimizer="none")
    hooks = weakref.ref(tierflow.current_session().step_stats)  # it holds the runtime (Note [Session lifetime])
    del model
    gc.collect()
    assert hooks() is None, "the optimizer's step hooks kept the session's runtime"
    opt.step()  # the hooks of a session gone do nothing


def test_trainer_callback_logs_ahead_of_the_reporters(device):
    callbacks = pytest.importorskip("transformers.trainer_callback", reason="transformers is a test dependency")
    from tierflow.hf_callback import StepStatsCallback

    seen = []

    class Reporter(callbacks.TrainerCallback):  # stands for TensorBoardCallback & co., which come first
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    model, opt = tiny(device)
    model, opt = tierflow.wrap(model, opt, device=device)
    model(batch(device, 0)).square().mean().backward()  # a step before training: not logged
    opt.step()
    opt.zero_grad()
    handler = callbacks.CallbackHandler([callbacks.DefaultFlowCallback, Reporter, StepStatsCallback()], model,
                                        None, opt, None)
    state, control = callbacks.TrainerState(), callbacks.TrainerControl()
    handler.on_train_begin(None, state, control)
    for i in range(2):
        model(batch(device, i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    handler.on_log(None, state, control, {"loss": 1.0})
    steps = step_stats()[1:]
    assert seen[0]["loss"] == 1.0
    assert seen[0]["tierflow/forward_s"] == pytest.approx(sum(s["forward_s"] for s in steps) / 2)
    assert seen[0]["tierflow/peak_pinned_host_bytes"] == max(s["peak_pinned_host_bytes"] for s in steps)
    assert seen[0]["tierflow/forwards"] == 1
    handler.on_log(None, state, control, {"eval_loss": 2.0})  # no step since: nothing added
    assert not any(k.startswith("tierflow/") for k in seen[1]), seen[1]


def test_a_step_below_an_earlier_steps_peak_reports_its_own(device):
    """Each boundary takes the meters' window peaks (Note [Window peak]): a step whose peak stays below an earlier
    step's, reached between two boundaries and gone by the next, reports that peak, not the readings at its marks."""
    model, opt = tiny(device)
    model, opt = tierflow.wrap(model, opt, device=device, offload_optimizer="none", offload_activations="none")
    runtime = tierflow.current_session().runtime
    base = tierflow._C.step_counters(runtime)["pinned_host_bytes"]
    for i, held_bytes in enumerate((1 << 20, 256 << 10)):  # held between the forward's end and the backward's begin
        loss = model(batch(device, i)).square().mean()
        held = runtime.host_empty([held_bytes // 4], "float32")  # from the pinned pool
        del held
        loss.backward()
        opt.step()
        opt.zero_grad()
    first, second = step_stats()
    assert tierflow._C.step_counters(runtime)["pinned_host_bytes"] == base, "nothing else held in the pool"
    assert first["peak_pinned_host_bytes"] == base + (1 << 20), first
    assert second["peak_pinned_host_bytes"] == base + (256 << 10), second  # below the first's, exact all the same


def test_a_smaller_batch_after_a_bigger_one_has_its_own_activation_peak(device):
    model, opt = tiny(device)
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations="host", min_offload_bytes=0)
    for i, rows in enumerate((BATCH, 4 * BATCH, BATCH)):
        model(batch(device, i).repeat(rows // BATCH, 1)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    small, big, small_again = step_stats()
    assert big["peak_device_activation_bytes"] > small["peak_device_activation_bytes"] > 0, (small, big)
    assert small_again["peaks_exact"], small_again
    assert small_again["peak_device_activation_bytes"] == small["peak_device_activation_bytes"], (small, small_again)


def test_a_parameter_fetch_wait_shows_in_its_step(device):
    torch.manual_seed(0)
    body = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(BLOCKS)]
    model = torch.nn.Sequential(*body, torch.nn.Linear(WIDTH, 1)).to(torch_device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierflow.wrap(model, opt, device=device, offload_params="host", blocks=body)
    waited = []
    for i in range(2):
        before = tierflow.report()["params"]["stall_ms"]
        model(batch(device, i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        waited.append((tierflow.report()["params"]["stall_ms"] - before) / 1e3)
    for s, w in zip(step_stats(), waited):
        assert w > 0, "every step waits for its blocks' first fetches"
        assert s["exposed_param_wait_s"] == pytest.approx(w, abs=1e-8), (s, w)
        assert s["exposed_param_wait_s"] <= s["forward_s"] + s["backward_s"], s


@pytest.mark.parametrize("accumulate,settings", [(2, {}), (1, {"overlap_step": "off"})],
                         ids=["accumulating", "no_stream"])
def test_the_python_paths_cpu_step_is_exposed_inside_step(device, accumulate, settings):
    """Gradient accumulation not declared (grad_accumulation_steps) steps every parameter in step()'s Python path,
    as does a CPUAdamW without a gradient stream: its time (the CPUAdamW's python_step_ns) is in
    exposed_cpu_step_s, not only the stream's."""
    model, opt = tiny(device)
    model, opt = tierflow.wrap(model, opt, device=device, offload_optimizer="host", **settings)
    for i in range(2):
        for micro in range(accumulate):
            model(batch(device, i * accumulate + micro)).square().mean().backward()
        before = opt.python_step_ns
        opt.step()
        opt.zero_grad()
    spent = (opt.python_step_ns - before) / 1e9
    last = step_stats(last=True)
    assert spent > 0 and last["exposed_cpu_step_s"] >= spent, (spent, last)
