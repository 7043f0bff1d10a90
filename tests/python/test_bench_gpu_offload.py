"""benchmarks/bench_gpu_offload.py on the emulated device: every mode runs, and offload does not change the losses."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

import tierflow

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
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")}
    known = {row["name"] for row in tierflow.config_table()}
    env.update({k: v for k, v in SUITE_ENVIRONMENT.items() if k in known})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "bindings", "python"),
                                                    env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, BENCH, "--preset", "tiny", "--device", "cpu", "--warmup", "3", "--steps", "2",
           "--modes", ",".join(MODES), "--nvme-path", nvme_dir, "--kernel-repeats", "2", "--out", str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        if nvme_dir != str(nvme):
            shutil.rmtree(nvme_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        data = json.load(f)
    return data, proc.stdout, nvme_dir


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
            assert r["compute_vs_predicted"] == pytest.approx(compute / r["predicted_step_seconds"]), r
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
    assert "60% of the baseline's saved activations" in data["config"]["auto_gpu_memory_note"]
    assert data["longest_seq"]["skipped"]
    for mode in MODES:
        assert mode in stdout  # the table
    assert "max |loss - baseline loss|" in stdout


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


def test_no_swap_files_are_left_behind(tiny_run):
    _, _, nvme_dir = tiny_run
    if os.path.isdir(nvme_dir):
        assert [f for f in os.listdir(nvme_dir) if f.startswith("tierflow-swap-")] == []


def test_gpt1b_preset_is_the_1_3b_model():
    proc = subprocess.run([sys.executable, BENCH, "--preset", "gpt1b", "--dry-run"], capture_output=True,
                          text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")})
    assert proc.returncode == 0, proc.stderr
    assert "parameters 1,348,063,232" in proc.stdout
    assert "built on the meta device: 1,348,063,232" in proc.stdout
