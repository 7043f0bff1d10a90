"""benchmarks/bench_ddp_optimizer.py runs end to end (two gloo ranks, a small model) and writes its JSON: each rank's
step time with the CPU AdamW partitioned across the ranks and without, their ratio, the states each rank holds (one
copy on the node, partitioned) and the losses, equal bit for bit. The speed itself is the benchmark's to report,
not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import subprocess_environment
from ranks import GLOO
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [GLOO, pytest.mark.ordering]  # the ranks train in children (Note [Test tiers])


def test_the_ddp_optimizer_benchmark_writes_both_settings_their_ratio_and_the_states_each_rank_holds(tmp_path):
    out = tmp_path / "ddp_optimizer.json"
    env = subprocess_environment()
    env.pop("LOCAL_WORLD_SIZE", None)
    done = run_child([sys.executable, os.path.join(ROOT, "benchmarks", "bench_ddp_optimizer.py"), "--params",
                           "3e5", "--width", "128", "--steps", "2", "--warmup", "1", "--rounds", "2", "--out",
                           str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["per_rank"]) == 2 and len(data["raw"]) == 2
    for s in data["per_rank"]:
        assert min(s["step_seconds"].values()) > 0 and s["unpartitioned_over_partitioned_step"] > 0
        states = s["state_elements_per_moment"]
        assert 0 < states["partitioned"] < states["unpartitioned"] == data["parameters"], states
        assert s["host_in_use_bytes"]["partitioned"] < s["host_in_use_bytes"]["unpartitioned"], s
        assert s["redone"] == {"partitioned": 0, "unpartitioned": 0}, s  # every step during backward committed
    for r in data["raw"]:
        assert len(r["rounds"]) == 2 and all(len(run["seconds"]) == 2 for rnd in r["rounds"] for run in rnd.values())
    assert data["partitioned_states_one_copy"] is True and data["losses_equal"] is True
    assert "unpartitioned / partitioned step" in done.stdout
