"""What the torch.distributed tests share: running a script as several gloo ranks, and a small MLP with the helpers
that train it and list its hooks (test_distributed.py, test_fsdp2.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

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
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read()
        log.close()
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text[-4000:]}"
        outputs.append(torch.load(d / f"rank{rank}.pt", weights_only=False))
    return outputs


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
