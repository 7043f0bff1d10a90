"""What the torch.distributed tests share: running a script as several gloo ranks, and a small MLP with the helpers
that train it and list its hooks (test_distributed.py, test_fsdp2.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

from children import HANG_GUARD_SECONDS, hang_guard_failure
from harness import subprocess_environment

GLOO = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                          reason="needs torch.distributed with the gloo backend")


def run_ranks(d, script: str, ranks: int = 2) -> list:
    """Runs ``script`` as ``ranks`` processes (argv: rank, store file, output file); each one's torch.load-ed output."""
    env = subprocess_environment()
    env.pop("LOCAL_WORLD_SIZE", None)  # the group is the machine's ranks (Note [Ranks on one machine])
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on loopback, whatever the host name resolves to
    procs, logs = [], []
    for rank in range(ranks):
        log = open(d / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(rank), str(d / "store"),
                                       str(d / f"rank{rank}.pt")], stdout=log, stderr=subprocess.STDOUT,
                                      env=env))
    try:
        # Under the hang guard (children.py), and a rank that failed ends the others at once: they would
        # otherwise wait in a collective for the gloo timeout.
        deadline = time.monotonic() + HANG_GUARD_SECONDS
        while True:
            codes = [p.poll() for p in procs]  # every rank's, each time: a later one may be the one that failed
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                hang_guard_failure(f"{ranks} gloo ranks", HANG_GUARD_SECONDS)
            time.sleep(0.05)
    finally:
        killed = [p.poll() is None for p in procs]
        for p, k in zip(procs, killed):
            if k:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    # The ranks that failed on their own first, then those ended because another failed.
    for rank in sorted(range(ranks), key=lambda r: killed[r]):
        why = " (killed: another rank had failed)" if killed[rank] else ""
        assert procs[rank].returncode == 0, \
            f"rank {rank} exited with {procs[rank].returncode}{why}:\n{texts[rank][-4000:]}"
    return [torch.load(d / f"rank{rank}.pt", weights_only=False) for rank in range(ranks)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def module_hooks(model: nn.Module) -> dict:
    """Every module hook tierflow.wrap may install, by module."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_state_dict_pre_hooks",
             "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
    return {name: tuple(tuple(getattr(m, k).keys()) for k in kinds) for name, m in model.named_modules()}


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> list:
    losses = []
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
