"""`make gpu-check` (scripts/gpu_check.sh): what it runs, and that it refuses where it cannot measure."""

import os
import shutil
import subprocess

import pytest
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def gpu_check(tmp_path, **env):
    # The checkout's own bundle/ (a developer's, with DeepSpeed in it, say) must not change what a case sees.
    full = dict(os.environ, GPU_CHECK_OUT=str(tmp_path / "out"), TIERFLOW_BUNDLE=str(tmp_path / "no-bundle"))
    full.update(env)
    return run_child(["bash", SCRIPT], cwd=ROOT, env=full, capture_output=True, text=True)


def test_dry_run_names_every_part(tmp_path):
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "would run" in line]
    assert [line.split("(")[1].split(")")[0] for line in lines] == ["build", "tests-cpp", "tests-cuda", "bench"]
    build, _, cuda, bench = lines
    assert "TIERFLOW_BUNDLE=" in build and "CMAKE_CUDA_ARCHITECTURES=native" in build and "scripts/setup.sh" in build
    assert "-k cuda" in cuda and "TIERFLOW_EMULATED_DEVICE=adversarial" in cuda
    assert "--preset gpt1b" in bench and "--seq-search" in bench
    assert "benchmarks/results/gpu_offload.json" in bench


def test_parts_run_in_the_order_given(tmp_path):
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="bench", GPU_CHECK_BENCH_ARGS="--steps 2")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "would run" in line]
    assert len(lines) == 1 and "(bench)" in lines[0] and lines[0].rstrip().endswith("--steps 2"), lines


def test_the_7b_part_is_opt_in_and_runs_tierflow_params_beside_zero3(tmp_path):
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="bench7b", TIERFLOW_BUNDLE=str(tmp_path / "none"))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "would run" in line]
    assert len(lines) == 1 and "(bench7b)" in lines[0], lines
    assert "--preset llama7b" in lines[0] and "--modes tierflow-params,deepspeed-zero3-offload" in lines[0]
    assert "benchmarks/results/gpu_offload_llama7b.json" in lines[0]


def test_the_sequence_part_is_opt_in_and_searches_beside_the_baseline_only(tmp_path):
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="seq", GPU_CHECK_SEQ_SECONDS="300")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "would run" in line]
    assert len(lines) == 1 and "(seq)" in lines[0], lines
    assert "--modes baseline --seq-search --seq-search-seconds 300" in lines[0]
    assert "benchmarks/results/gpu_offload_seq.json" in lines[0]


def test_the_cpp_part_is_opt_in_and_runs_the_cpp_example(tmp_path):
    """The C++ trainer on CUDA (its auto, steps during backward, parameters on the host, GPU share) against LibTorch."""
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="cpp")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "would run" in line]
    assert lines == ["[gpu-check] would run (cpp): bash scripts/cpp_example.sh"], lines


def test_a_part_that_does_not_exist_is_refused(tmp_path):
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="build test")
    assert proc.returncode == 2
    assert "'test' is not a part; accepted: build, tests, bench, seq, bench7b" in proc.stderr


def test_without_a_gpu_it_refuses_and_says_why(tmp_path):
    smi = shutil.which("nvidia-smi")
    if smi and run_child([smi, "-L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is present here: gpu-check would run for real")
    proc = gpu_check(tmp_path)
    assert proc.returncode == 2
    assert "no CUDA GPU here" in proc.stderr and "make test" in proc.stderr
    assert not (tmp_path / "out").exists(), "nothing written before the refusal"


def test_the_bundle_goes_to_the_build_only_and_the_options_reach_their_part(tmp_path):
    bundle = str(tmp_path / "bundle")
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", TIERFLOW_BUNDLE=bundle, GPU_CHECK_SEQ_SEARCH="0",
                     GPU_CHECK_PYTEST_ARGS="-n 8")
    assert proc.returncode == 0, proc.stderr
    build, _, cuda, bench = [line for line in proc.stdout.splitlines() if "would run" in line]
    assert f"TIERFLOW_BUNDLE={bundle}" in build
    # tierflow refuses TIERFLOW_* variables it does not know: the tests and the bench must not inherit it.
    assert "TIERFLOW_BUNDLE" not in cuda + bench
    assert cuda.rstrip().endswith("-n 8") and "GPU_CHECK_FAILURE_LOG=" in cuda
    assert "--seq-search" not in bench
    script = open(SCRIPT).read()
    assert "unset TIERFLOW_BUNDLE" in script.split("for part in $PARTS")[0]


def test_deepspeed_comes_from_the_bundle_before_the_benchmark_when_the_machine_lacks_it(tmp_path):
    """BUNDLE_DEEPSPEED=1 make bundle puts DeepSpeed's wheel and its requirements in bundle/deepspeed/; the bench
    part installs them from there (no index; DeepSpeed without its requirements, which name torch; the rest
    resolved among the bundle's wheels for this Python) before the benchmark."""
    if run_child([os.path.join(ROOT, ".venv", "bin", "python"), "-c", "import deepspeed"],
                      capture_output=True).returncode == 0:
        pytest.skip("deepspeed is installed here: gpu-check would not install it")
    wheels = tmp_path / "bundle" / "deepspeed"
    wheels.mkdir(parents=True)
    for name in ("deepspeed-0.19.8-py3-none-any.whl", "hjson-3.1.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="bench", TIERFLOW_BUNDLE=str(tmp_path / "bundle"))
    assert proc.returncode == 0, proc.stderr
    install, bench = [line for line in proc.stdout.splitlines() if "would run" in line]
    assert "(deepspeed)" in install and f"--no-index --find-links '{wheels}'" in install, install
    assert "--no-deps deepspeed" in install and "hjson py-cpuinfo msgpack nvidia-ml-py einops ninja pydantic" in install
    assert "(bench)" in bench
    # The 7B part's peer is DeepSpeed too: installed the same way, once.
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="bench7b bench", TIERFLOW_BUNDLE=str(tmp_path / "bundle"))
    parts = [line.split("(")[1].split(")")[0] for line in proc.stdout.splitlines() if "would run" in line]
    assert parts == ["deepspeed", "bench7b", "bench"], parts
    # Without the directory, nothing is installed.
    proc = gpu_check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_PARTS="bench")
    assert [line for line in proc.stdout.splitlines() if "would run" in line][0].count("(bench)") == 1
