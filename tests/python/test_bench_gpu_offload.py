"""benchmarks/bench_gpu_offload.py on the emulated device: every mode runs, and offload does not change the losses."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

import tierflow
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "bench_gpu_offload.py")
MODES = ["baseline", "save_on_cpu", "checkpoint", "tierflow-host", "tierflow-nvme", "tierflow-host-opt",
         "tierflow-auto", "tierflow-auto-fits"]
AUTO_MODES = ["tierflow-auto", "tierflow-auto-fits"]  # the planner: 3 warm-up steps at least
# torch's AdamW, activations copied or recomputed exactly
EXACT_MODES = ["save_on_cpu", "checkpoint", "tierflow-host", "tierflow-nvme"] + AUTO_MODES
# What `make test-python` sets for the whole suite (the emulated device's mode and seed), read at import,
# before any fixture runs: the benchmark's workers run with these and no other TIERFLOW_* variable.
SUITE_ENVIRONMENT = {k: os.environ[k] for k in ("TIERFLOW_EMULATED_DEVICE", "TIERFLOW_EMULATED_SEED")
                     if k in os.environ}
EMULATED_DEVICE = SUITE_ENVIRONMENT.get("TIERFLOW_EMULATED_DEVICE")


def _fs_type(path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from bench_gpu_offload import fs_type
    finally:
        sys.path.pop(0)
    return fs_type(path)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny preset, 3 warm-up + 2 measured steps, all modes, on the CPU; the JSON and the printed table."""
    tmp = tmp_path_factory.mktemp("bench_gpu_offload")
    nvme = tmp / "nvme"
    nvme.mkdir()
    nvme_dir = str(nvme)
    if _fs_type(nvme_dir) == "tmpfs":  # no O_DIRECT there; the build tree is on a real file system
        nvme_dir = os.path.join(ROOT, "build", f"bench-gpu-offload-test-{os.getpid()}")
        os.makedirs(nvme_dir, exist_ok=True)
    out = tmp / "tiny.json"
    env = _bench_env()
    cmd = [sys.executable, BENCH, "--preset", "tiny", "--device", "cpu", "--warmup", "3", "--steps", "2",
           "--modes", ",".join(MODES), "--nvme-path", nvme_dir, "--kernel-repeats", "2", "--out", str(out)]
    try:
        proc = run_child(cmd, env=env, capture_output=True, text=True)
    finally:
        if nvme_dir != str(nvme):
            shutil.rmtree(nvme_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        data = json.load(f)
    return data, proc.stdout, nvme_dir


@pytest.mark.ordering
def test_every_mode_runs_and_records_its_measurements(tiny_run):
    data, stdout, _ = tiny_run
    assert data["device"] == "emulated" and data["preset"] == "tiny"
    assert data["config"]["steps"] == 2 and data["config"]["warmup"] == 3 and data["config"]["dtype"] == "fp32"
    assert data["host"]["cpu_count"] >= 1 and data["torch"]
    assert list(data["modes"]) == MODES
    for mode, r in data["modes"].items():
        assert "error" not in r, f"{mode}: {r.get('error')}\n{r.get('traceback', '')}{r.get('stderr_tail', '')}"
        assert len(r["losses"]) == 5, mode
        assert all(math.isfinite(x) for x in r["losses"]), (mode, r["losses"])
        for key in ("step_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds"):
            assert r[key] > 0, (mode, key, r[key])
        assert r["forward_seconds"] + r["backward_seconds"] + r["optimizer_seconds"] <= r["step_seconds"] * 1.01
        # No device allocator on the CPU: the peak is absent, with the reason given.
        assert "device_peak_bytes" in r and r["device_peak_bytes"] is None and r["device_peak_note"], mode
        assert data["ratios"][mode] > 0
        assert mode in data["peak_ratio"]
        if mode in AUTO_MODES:
            assert r["plan"]["summary"] and len(r["plan"]["modes"]) == 2, r.get("plan")
            # Predicted beside measured (issue 17): the plan's figures, and the measured ones over them.
            assert r["predicted_step_seconds"] == r["plan"]["predicted_step_seconds"] > 0, r
            assert r["predicted_peak_bytes"] == r["plan"]["predicted_device_peak_bytes"] > 0, r
            compute = r["forward_seconds"] + r["backward_seconds"]
            # The blocks' part beside the measured forward + backward; the whole step beside the whole prediction.
            assert r["predicted_blocks_seconds"] == r["plan"]["predicted_blocks_seconds"] > 0, r
            assert r["predicted_step_seconds"] == pytest.approx(r["predicted_blocks_seconds"] + r["rest_of_step_seconds"])
            assert r["compute_vs_predicted"] == pytest.approx(compute / r["predicted_blocks_seconds"]), r
            assert r["step_vs_predicted"] == pytest.approx(r["step_seconds"] / r["predicted_step_seconds"]), r
            assert r["peak_vs_predicted"] is None, "no reserved peak on the emulated device"
            assert f"{mode}: predicted blocks' forward + backward" in stdout
        if mode == "tierflow-auto-fits":  # everything fits the default budget: nothing moves
            assert r["plan"]["modes"] == ["keep", "keep"]
            assert r["tierflow"]["per_measured_step"]["activations.packs"] == 0
        elif mode.startswith("tierflow"):
            assert r["tierflow_report"]["device"] == "emulated"
            per_step = r["tierflow"]["per_measured_step"]
            assert per_step["links.gpu_to_host_bytes"] > 0 and per_step["links.host_to_gpu_bytes"] > 0, per_step
            assert per_step["activations.offloaded_bytes"] > 0, per_step
            assert per_step["prefetch.hits"] is not None and per_step["prefetch.stalls"] is not None
            assert r["tierflow"]["peaks"]["host_pool.in_use.peak"] > 0
    assert data["ratios"]["baseline"] == 1.0
    assert data["modes"]["baseline"]["saved_activations_bytes"] > 0
    nvme = data["modes"]["tierflow-nvme"]["tierflow"]["per_measured_step"]
    assert nvme["activations.nvme.write_bytes"] > 0 and nvme["activations.nvme.reads"] > 0, nvme
    opt = data["modes"]["tierflow-host-opt"]
    assert opt["optimizer"].endswith("CPUAdamW")
    assert opt["tierflow"]["per_measured_step"]["optimizer.steps"] > 0
    assert opt["cpu_step_kernel_seconds"] > 0
    assert opt["cpu_step_kernel_elements"] == data["config"]["parameters"] == opt["parameters"]
    # TIERFLOW_OFFLOAD_GRADIENTS=on in the CPU-optimizer modes: each step's gradients freed before step().
    assert opt["tierflow_settings"]["offload_gradients"] == "on"
    assert opt["grad_bytes_freed_before_step_per_step"] == opt["grad_bytes_to_host_per_step"] > 0
    if EMULATED_DEVICE and "TIERFLOW_EMULATED_DEVICE" in {row["name"] for row in tierflow.config_table()}:
        # The workers ran on the emulated device in the mode this suite was started with.
        assert data["modes"]["tierflow-host"]["tierflow_report"]["config"]["TIERFLOW_EMULATED_DEVICE"] == \
            EMULATED_DEVICE
    assert "60% of the baseline's saved activations" in data["config"]["auto_gpu_memory_note"]["tierflow-auto"]
    assert data["longest_seq"]["skipped"]
    assert data["longest_seq"]["prediction"]["label"] == "prediction, not measured"
    for mode in MODES:
        assert mode in stdout  # the table
    assert "max |loss - baseline loss|" in stdout


@pytest.mark.ordering
def test_offload_keeps_the_baseline_losses(tiny_run):
    data, _, _ = tiny_run
    base = data["modes"]["baseline"]["losses"]
    for mode in MODES[1:]:
        losses = data["modes"][mode]["losses"]
        # Same initial weights, same data: the first forward is the same computation.
        assert losses[0] == base[0], (mode, losses[0], base[0])
        assert data["loss_vs_baseline"][mode]["first_step_bit_identical"]
    for mode in EXACT_MODES:
        # torch's AdamW and exact copies of the activations: every step is the baseline's.
        losses = data["modes"][mode]["losses"]
        for step, (a, b) in enumerate(zip(losses, base)):
            assert abs(a - b) <= 1e-6 * abs(b), (mode, step, a, b)
    # tierflow's CPU AdamW differs from torch's by rounding only (README: 1e-6 relative per step).
    for step, (a, b) in enumerate(zip(data["modes"]["tierflow-host-opt"]["losses"], base)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)


@pytest.mark.ordering
def test_no_swap_files_are_left_behind(tiny_run):
    _, _, nvme_dir = tiny_run
    if os.path.isdir(nvme_dir):
        assert [f for f in os.listdir(nvme_dir) if f.startswith("tierflow-swap-")] == []


def test_gpt1b_preset_is_the_1_3b_model():
    proc = run_child([sys.executable, BENCH, "--preset", "gpt1b", "--dry-run"], capture_output=True,
                     text=True,
                     env={k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")})
    assert proc.returncode == 0, proc.stderr
    assert "parameters 1,348,063,232" in proc.stdout
    assert "built on the meta device: 1,348,063,232" in proc.stdout


def _bench_env() -> dict:
    """The benchmark's environment: the suite's TIERFLOW_* settings only, and this tree's package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")}
    known = {row["name"] for row in tierflow.config_table()}
    env.update({k: v for k, v in SUITE_ENVIRONMENT.items() if k in known})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "bindings", "python"),
                                                    env.get("PYTHONPATH")) if p)
    return env


# tierflow-params (issue 18) on the CPU: the tiny-params preset, whose 16 blocks' parameters are several times
# its params_gpu_memory (the 2-layer tiny preset's two blocks and rest unit are nearly all of its parameters,
# and the schedule needs two blocks and the rest unit on the device at once).
PARAMS_MODES = ["baseline", "tierflow-params", "deepspeed-zero3-offload"]
PARAMS_BUDGET = 1 << 20  # the tiny-params preset's params_gpu_memory, 1MiB


@pytest.fixture(scope="module")
def params_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu_offload_params") / "tiny-params.json"
    env = _bench_env()
    cmd = [sys.executable, BENCH, "--preset", "tiny-params", "--device", "cpu", "--warmup", "3", "--steps", "2",
           "--modes", ",".join(PARAMS_MODES), "--out", str(out)]
    proc = run_child(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f), proc.stdout


@pytest.mark.ordering
def test_tierflow_params_trains_the_baseline_within_its_device_budget(params_run):
    data, stdout = params_run
    assert data["config"]["params_gpu_memory"] == "1MiB"
    base, r = data["modes"]["baseline"], data["modes"]["tierflow-params"]
    assert "error" not in r, f"{r.get('error')}\n{r.get('traceback', '')}{r.get('stderr_tail', '')}"
    assert r["tierflow_settings"]["offload_params"] == "host" and r["tierflow_settings"]["gpu_memory"] == "1MiB"
    assert r["optimizer"].endswith("CPUAdamW") and r["tierflow_settings"]["offload_gradients"] == "on"
    # The CPU optimizer's rounding of torch's AdamW, as tierflow-host-opt; the first step the same computation.
    assert r["losses"][0] == base["losses"][0]
    for step, (a, b) in enumerate(zip(r["losses"], base["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    p, per = r["params"], r["params_per_measured_step"]
    assert p["host_bytes"] == 4 * data["config"]["parameters"] >= 3 * PARAMS_BUDGET, p
    assert 0 < p["device_peak_bytes"] <= PARAMS_BUDGET, p
    assert per["fetches"] > 0 and per["prefetch_hits"] > 0 and per["stalls"] >= 0, per
    assert per["host_to_device_bytes"] >= 2 * p["host_bytes"], per  # every weight up in forward and in backward
    links = r["per_link_bytes_per_step"]
    assert links["host_to_device"]["total"] >= links["host_to_device"]["weights"] == per["host_to_device_bytes"]
    assert links["device_to_host"]["gradients"] == p["host_bytes"] <= links["device_to_host"]["total"], links
    assert r["tokens_per_second"] == pytest.approx(64 / r["step_seconds"])
    assert r["mfu"] is None and "CPU" in r["mfu_note"]
    assert "tierflow-params: parameters" in stdout and "prefetch hits" in stdout


@pytest.mark.ordering
def test_deepspeed_zero3_offload_is_skipped_with_the_reason_and_the_prediction_is_labelled(params_run):
    data, stdout = params_run
    ds = data["modes"]["deepspeed-zero3-offload"]
    assert "error" not in ds and ds["skipped"], ds
    assert data["params_vs_zero3"] is None and data["params_vs_zero3_note"]
    pred = data["params_prediction"]
    assert pred["label"] == "prediction, not measured" and pred["step_seconds"] > 0
    assert "params_prediction_vs_measured" not in data  # an H100's prediction is not read against the CPU
    assert "PREDICTED on an H100 (not measured)" in stdout


def test_llama7b_preset_is_the_7b_llama_shape_and_its_prediction_is_gpu_md_arithmetic():
    proc = run_child([sys.executable, BENCH, "--preset", "llama7b", "--dry-run",
                           "--modes", "tierflow-params,deepspeed-zero3-offload"], capture_output=True, text=True, env={k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")})
    assert proc.returncode == 0, proc.stderr
    # Llama-2-7B's 6,738,415,616, plus this GPT's attention biases, LayerNorm biases and learned positions.
    assert "parameters 6,755,983,360" in proc.stdout
    assert "built on the meta device: 6,755,983,360" in proc.stdout
    assert "32 layers, d_model 4096, 32 heads, MLP swiglu 11008, seq 4096, batch 1" in proc.stdout
    assert "PREDICTION (not measured)" in proc.stdout
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from gpu_offload_predict import predict_params_offload
    finally:
        sys.path.pop(0)
    cfg = dict(n_layer=32, d_model=4096, seq_len=4096, batch=1, mlp_hidden=11008, mlp="swiglu")
    d, h, n = 4096, 11008, 6_755_983_360
    block = 4 * d * d + 4 * d + 2 * 2 * d + 3 * d * h  # attention with biases, two LayerNorms, SwiGLU
    pred = predict_params_offload(cfg, n, block, 16 << 30)
    assert pred["param_bytes_host_to_device"] == 2 * 2 * n and pred["grad_bytes_device_to_host"] == 2 * n
    assert pred["cpu_adamw_seconds"] == pytest.approx(n / 5.0e9)
    assert pred["step_seconds"] == pytest.approx(pred["forward_seconds"] + pred["backward_seconds"])
    assert pred["mfu"] == pytest.approx(6 * n * 4096 / pred["step_seconds"] / 989e12)


def test_each_phase_keeps_its_largest_device_peak(monkeypatch):
    """gpu_offload_worker.PhasePeaks (CUDA only; the allocator's counters are faked here): per phase the largest
    peak over the measured steps, what forward leaves allocated, nothing before measuring or without a device."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from gpu_offload_worker import PhasePeaks
    finally:
        sys.path.pop(0)
    now = {"peak": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: now["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2 * now["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: now["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: now.update(peak=0))
    peaks = PhasePeaks(torch.device("cpu"))
    for step, (forward, backward) in enumerate([(5, 9), (7, 8)]):
        peaks.measuring = step > 0  # the first step is a warm-up: not counted
        peaks.begin_step()
        now.update(peak=forward if step else 100, allocated=forward - 1)
        peaks.end_phase("forward")
        now.update(peak=backward)
        peaks.end_phase("backward")
    result = {}
    peaks.into(result)
    assert result["device_phase_bytes"] == {"forward_allocated": 7, "forward_reserved": 14,
                                            "after_forward_allocated": 6, "backward_allocated": 8,
                                            "backward_reserved": 16}
    nothing = {}
    PhasePeaks(None).into(nothing)
    assert nothing == {}


@pytest.mark.ordering
def test_the_cpu_kernel_alone_steps_every_parameter_with_states_off_the_host_copied():
    """gpu_offload_modes.time_cpu_step_kernel: a parameter whose states live on the device (the GPU share;
    here the meta device stands in for CUDA) is timed on host copies, not refused by the CPU kernel (the
    H100 run lost tierflow-opt's figures so); host states are stepped in place."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from gpu_offload_modes import time_cpu_step_kernel
    finally:
        sys.path.pop(0)
    model = torch.nn.Linear(64, 32)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    weight, bias = model.weight, model.bias
    host_master = opt.state[weight]["master"]
    before, bias_before = host_master.clone(), bias.detach().clone()
    opt.state[bias] = dict(opt.state[bias], **{k: torch.empty(bias.numel(), device="meta")
                                               for k in ("master", "exp_avg", "exp_avg_sq")})
    out = time_cpu_step_kernel(model._tierflow_session.runtime, opt, repeats=2)
    assert out["cpu_step_kernel_elements"] == weight.numel() + bias.numel()
    assert out["cpu_step_kernel_seconds"] > 0
    assert not torch.equal(host_master, before), "a state on the host is the one stepped"
    assert torch.equal(bias.detach(), bias_before), "a host copy of the parameter, never the parameter itself"
    tierflow.unwrap(model)


def _bench_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_gpu_offload
    finally:
        sys.path.pop(0)
    return bench_gpu_offload


def _seq_module():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_offload_seq
    finally:
        sys.path.pop(0)
    return gpu_offload_seq


def test_the_sequence_search_closes_in_on_the_limit_in_few_trials():
    """gpu_offload_seq.search_longest against a fake device whose limit is 52,000 tokens: from a prediction
    near it, within one grain in at most 6 trials; from none (growing), still within the grain with enough
    trials; a trial cap and a passed deadline stop it and say so."""
    import time as _time

    seq = _seq_module()
    limit = 52_000
    tried = []

    def trains(n):
        tried.append(n)
        return {"step_seconds": n / 1e4} if n <= limit else None

    far = _time.monotonic() + 3600
    r = seq.search_longest(trains, 8192, None, 51_200, trials=6, deadline=far)
    assert r["stopped"] == "found" and limit - seq.GRAIN < r["seq"] <= limit and r["seq"] % seq.GRAIN == 0
    assert tried[0] == 51_200 and len(tried) <= 6 and r["result"] == {"step_seconds": r["seq"] / 1e4}
    tried.clear()
    r = seq.search_longest(trains, 4096, None, None, trials=30, deadline=far)
    assert r["stopped"] == "found" and limit - seq.GRAIN < r["seq"] <= limit
    assert r["trials"] == [[n, n <= limit] for n in tried]
    r = seq.search_longest(trains, 4096, None, None, trials=2, deadline=far)
    assert r["stopped"] == "trials" and len(r["trials"]) == 2 and r["seq"] < limit
    r = seq.search_longest(trains, 4096, None, None, trials=5, deadline=_time.monotonic() - 1)
    assert r["stopped"] == "deadline" and r["trials"] == [] and r["seq"] == 4096 and r["result"] is None
    # A prediction past a known failure is not tried; the interval is halved instead.
    tried.clear()
    r = seq.search_longest(trains, 8192, 60_000, 70_000, trials=10, deadline=far)
    assert tried[0] < 60_000 and r["stopped"] == "found"


def test_the_sequence_prediction_is_where_a_linear_peak_meets_the_capacity():
    seq = _seq_module()
    # 8 GB fixed, 1.3 MB per token: 4096 -> 13.3 GB, 8192 -> 18.6 GB; 76.8 GB reached at 52,900 (down to 1024s).
    at = lambda n: 8e9 + 1.3e6 * n  # noqa: E731
    assert seq.predicted_longest(4096, at(4096), 8192, at(8192), 76.8e9) == 52_224
    assert seq.predicted_longest(4096, 5e9, 8192, 5e9, 76.8e9) is None, "a peak that does not grow predicts nothing"


def test_the_sequence_search_runs_checkpoint_then_the_planner_at_twice_its_longest():
    """gpu_offload_seq.seq_search with a fake run_mode (checkpoint's limit 20,480, the planner's 45,056): the
    first trials are the preset's sequence and twice it, the prediction from their peaks next; the planner is
    tried first at twice checkpointing's longest; the ratios are the target's."""
    seq = _seq_module()
    modes = sys.modules["gpu_offload_modes"]  # imported by gpu_offload_seq
    limits = {"checkpoint": 20_480, "tierflow-auto-fits": 45_056}
    calls = []

    def run_mode(mode, cfg, timeout):
        calls.append((mode, cfg["seq_len"]))
        n = cfg["seq_len"]
        # The worker's own rule (gpu_offload_worker.model_and_batches): a planned mode refuses fewer warm-ups.
        if cfg["warmup"] < modes.warmup_needed(mode):
            return {"mode": mode, "error": f"ValueError: {mode} needs --warmup {modes.warmup_needed(mode)}"}
        assert cfg["steps"] == 1
        if n > limits[mode]:
            return {"mode": mode, "error": "OutOfMemoryError: CUDA out of memory"}
        return {"mode": mode, "step_seconds": n / 2e4 * (1.1 if mode != "checkpoint" else 1.0),
                "device_peak_bytes": 8e9 + 3.5e6 * n, "device_total_bytes": 8e10}

    cfg = {"device": "cuda", "seq_len": 4096, "batch": 2}
    out = seq.seq_search(cfg, run_mode, 100.0, trials=6, seconds=3600)
    assert calls[:2] == [("checkpoint", 4096), ("checkpoint", 8192)]
    assert out["checkpoint"]["seq"] == 20_480 and out["checkpoint"]["tried_first"] == calls[2][1]
    first_auto = next(n for m, n in calls if m == "tierflow-auto-fits")
    assert first_auto == 2 * 20_480 == out["tierflow-auto-fits"]["tried_first"]
    assert out["tierflow-auto-fits"]["seq"] > 40_960 and out["seq_ratio"] == out["tierflow-auto-fits"]["seq"] / 20_480
    assert out["tokens_per_second_ratio"] == pytest.approx(1 / 1.1)
    assert seq.seq_search(dict(cfg, device="cpu"), run_mode, 100.0, 6, 60)["skipped"]


def test_the_first_guess_follows_each_phase_not_the_step_peak():
    """At 4096 tokens checkpointing's step peaks in torch's AdamW step (12.63 GiB on the H100), which does not grow
    with the sequence; a line through that and 8192's backward peak would aim far past the limit. Each phase's own
    line meets the capacity where the backward does."""
    seq = _seq_module()
    G = 1 << 30
    fixed, per = 7.53 * G, (3.81 * G) / 4096
    a = {"forward_allocated": fixed + 3.33 * G, "backward_allocated": fixed + 3.81 * G,
         "optimizer_allocated": 12.63 * G, "forward_reserved": 15.6 * G}
    b = {"forward_allocated": fixed + 6.66 * G, "backward_allocated": fixed + 7.62 * G,
         "optimizer_allocated": 12.63 * G, "forward_reserved": 40 * G}  # not a line the guess follows
    cap = 76.8 * G
    guess = seq.predicted_longest_by_phase(4096, a, 8192, b, cap)
    assert guess == int((cap - fixed) / per) // seq.GRAIN * seq.GRAIN
    allocated = [max(v for k, v in phases.items() if k.endswith("_allocated")) for phases in (a, b)]
    step_peak = seq.predicted_longest(4096, allocated[0], 8192, allocated[1], cap)
    assert step_peak > 1.4 * guess, "the step's peak alone overshoots (by 46% here)"
    assert seq.predicted_longest_by_phase(4096, {"optimizer_allocated": 1.0}, 8192, {"optimizer_allocated": 1.0},
                                          cap) is None


def test_the_longest_sequence_prediction_matches_the_h100s_peaks_and_says_the_target_is_missed():
    """predict_longest's memory lines at the preset's sequence against what an H100 measured there (committed:
    benchmarks/results/gpu_offload_h100_2f5cf58.json): checkpointing's forward and backward peaks, and
    tierflow-host's (every saved tensor on the host: the planner's line, where only the loss's arrays and one
    block's input stay) within 1.5% (they are within 0.7%; 11 or 13 bytes a logit at the loss's backward would
    leave it). From those lines the target (twice checkpointing's sequence at 0.9 of its tokens/s) is predicted
    missed on this model: the fp32 loss's arrays limit both; with a chunked loss the blocks limit, still short
    of twice within the planner's default budget, and causal attention's work per token costs the tokens/s."""
    bench = _bench_module()
    seq = _seq_module()
    cfg = bench.resolve(bench.parse_args(["--preset", "gpt1b", "--device", "cpu"]))
    n = bench.estimate(cfg)["parameters"]
    with open(os.path.join(ROOT, "benchmarks", "results", "gpu_offload_h100_2f5cf58.json")) as f:
        measured = json.load(f)
    assert measured["config"]["seq_len"] == cfg["seq_len"] and measured["config"]["parameters"] == n
    lines = seq._phase_lines(cfg, n, chunked_loss=False)

    def at(which, phases):
        return max(lines[p][0] + lines[p][which] * cfg["seq_len"] for p in phases)

    for mode, which in (("checkpoint", 1), ("tierflow-host", 2)):
        phase = measured["modes"][mode]["device_phase_bytes"]
        assert at(which, ["forward"]) == pytest.approx(phase["forward_allocated"], rel=0.015), mode
        assert at(which, ["loss_backward", "last_block_backward", "block0_backward"]) == \
            pytest.approx(phase["backward_allocated"], rel=0.015), mode

    p = seq.predict_longest(cfg, n)
    assert p["label"] == "prediction, not measured"
    run, chunked = p["as_run"], p["loss_chunked"]
    assert run["checkpoint_limited_by"] == run["planner_limited_by"] == "loss_backward"
    assert 60_000 < run["checkpoint_seq"] < run["planner_seq"] < 2 * run["checkpoint_seq"]
    assert chunked["checkpoint_limited_by"] == "last_block_backward" != chunked["planner_limited_by"]
    assert run["seq_ratio"] < chunked["seq_ratio"] < 2 and chunked["tokens_per_second_ratio"] < 0.9
    assert p["tokens_per_second_target_unreachable_past_seq"] < run["checkpoint_seq"]
    bound = p["tokens_per_second_target_unreachable_past_seq"]
    a, x = 2 * n, 2 * bound * cfg["d_model"] * cfg["n_layer"]
    assert 4 / 3 * (a + x) / (a + 2 * x) == pytest.approx(0.9, abs=1e-3)
    # Beside a search's measurement: measured over predicted.
    ratios = seq.beside_measured(p, {"checkpoint": {"seq": run["checkpoint_seq"]}, "tierflow-auto-fits": {"seq": 0},
                                     "seq_ratio": run["seq_ratio"] / 2})
    assert ratios["checkpoint_seq"] == 1.0 and ratios["seq_ratio"] == 0.5 and ratios["planner_seq"] == 0.0
    assert ratios["tokens_per_second_ratio"] is None


@pytest.mark.parametrize("mode", ["checkpoint", "tierflow-auto-fits"])
@pytest.mark.ordering
def test_a_search_trial_trains_in_the_real_worker(mode, monkeypatch):
    """The search runs only on CUDA, so its trials' configuration is run here by the benchmark's own worker on the
    CPU (the tiny preset at twice its sequence): each mode accepts it and trains its one measured step."""
    bench = _bench_module()
    seq = _seq_module()
    cfg = bench.resolve(bench.parse_args(["--preset", "tiny", "--device", "cpu"]))
    for key in [k for k in os.environ if k.startswith("TIERFLOW_") and k not in SUITE_ENVIRONMENT]:
        monkeypatch.delenv(key)  # the worker inherits this process's environment: the suite's settings only
    r = bench.run_mode(mode, seq.trial_config(cfg, mode, 2 * cfg["seq_len"]), 120)
    assert "error" not in r, r.get("error", "") + r.get("stderr_tail", "")
    assert r["step_seconds"] > 0 and len(r["losses"]) == seq.trial_config(cfg, mode, 1)["warmup"] + 1
