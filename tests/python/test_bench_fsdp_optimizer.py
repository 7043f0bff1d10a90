"""benchmarks/bench_fsdp_optimizer.py runs end to end (two gloo ranks, a small model) and writes its JSON: the
step times of both optimizers on each rank, their ratio, and the CPU AdamW's states one copy on the node. The
speed itself is the benchmark's to report, not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from harness import subprocess_environment
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                 reason="needs torch.distributed with the gloo backend"),
              pytest.mark.ordering]  # the ranks train in children (Note [Test tiers])


def test_the_fsdp_optimizer_benchmark_writes_both_optimizers_and_their_ratio(tmp_path):
    out = tmp_path / "fsdp_optimizer.json"
    env = subprocess_environment()
    env.pop("LOCAL_WORLD_SIZE", None)
    done = run_child([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fsdp_optimizer.py"), "--params",
                           "3e5", "--width", "128", "--steps", "2", "--warmup", "1", "--out", str(out)],
                     env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["ranks"]) == 2 and data["parameters"] == sum(r["shard_parameters"] for r in data["ranks"])
    for r in data["ranks"]:
        assert len(r["seconds"]["torch"]) == len(r["seconds"]["tierflow"]) == 2 and min(r["seconds"]["torch"]) > 0
        assert 0 < r["shard_parameters"] < data["parameters"]
    assert data["torch_over_tierflow_step"] > 0 and len(data["torch_over_tierflow_step_per_rank"]) == 2
    assert data["tierflow_states_one_copy"] is True
    assert data["torch_over_tierflow_streamed_backward_and_step"] > 0
    assert data["streamed_early_steps_committed"] is True and data["streamed_losses_equal_step_only"] is True
    assert data["max_abs_loss_difference"] < 1e-3  # the same model trained by both
    assert "PREDICTION" in data["multi_gpu_peer"]
    assert "torch / tierflow" in done.stdout
