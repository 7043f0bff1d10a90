"""Running a benchmark's worker as several gloo ranks on this machine (bench_fsdp_optimizer.py,
bench_ddp_optimizer.py): each rank is the same script started with --rank, --store and --worker-out, and writes its
results as JSON there."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_ranks(script: str, args: argparse.Namespace, passed: tuple, timeout_s: float = 3600) -> list:
    """Starts ``args.ranks`` processes of ``script`` (the options named in ``passed`` passed on from ``args``);
    each rank's JSON, in rank order. Raises SystemExit naming the exit codes when a rank fails."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "bindings", "python"),
                                                                         os.environ.get("PYTHONPATH")])))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.pop("LOCAL_WORLD_SIZE", None)  # the group is the machine's ranks (Note [Ranks on one machine])
        procs = []
        for rank in range(args.ranks):
            cmd = [sys.executable, os.path.abspath(script), "--rank", str(rank), "--store",
                   os.path.join(tmp, "store"), "--worker-out", os.path.join(tmp, f"rank{rank}.json")]
            cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in passed]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait(timeout=timeout_s) for p in procs]
        if any(codes):
            raise SystemExit(f"{os.path.basename(script)}: a rank failed (exit codes {codes})")
        out = []
        for rank in range(args.ranks):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                out.append(json.load(f))
        return out
