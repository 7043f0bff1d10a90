"""How fast the links are: copies between the device and pinned host memory, timed through tierflow's copy
engine (the planner's links, the gradient stream's bucket size and ``python -m tierflow plan`` all use it)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from . import _C


def probe_bytes(runtime: Any, most: int = 32 << 20) -> int:
    """The link probe's buffer size (tiering::link_probe_bytes): at most ``most`` and 1/16 of the host room
    left, so its two pinned buffers take at most an eighth of what TIERFLOW_HOST_MEMORY leaves."""
    pool = runtime.stats().get("host_pool", {})
    in_use = int(pool.get("in_use", {}).get("current", 0)) if isinstance(pool, dict) else 0
    return int(_C.link_probe_bytes(int(runtime.host_budget_bytes()), in_use, most))


def measure_links(runtime: Any, device: torch.device, nbytes: Optional[int] = None, shares: bool = False) -> dict:
    """Copy bandwidths between this device and pinned host memory, in bytes/s, through tierflow's copy engine;
    with ``shares``, also the device's compute speed left while both copies run (the planner's
    ``compute_share_during_copies``, Note [Activation planner]).

    Its pinned buffers go back to the pool when it returns (an empty slab the pool releases when it needs
    the room)."""
    nbytes = probe_bytes(runtime) if nbytes is None else nbytes
    n = nbytes // 4
    src = torch.zeros(n, dtype=torch.float32, device=device)
    host = runtime.host_empty([n], "float32")
    host2 = runtime.host_empty([n], "float32")
    back = torch.empty(n, dtype=torch.float32, device=device)

    def timed(fn: Any) -> float:
        fn()  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    d2h = nbytes / timed(lambda: runtime.copy_to_host(host, src).wait())
    h2d = nbytes / timed(lambda: runtime.copy_to_device(back, host2).wait())

    def both() -> None:
        a = runtime.copy_to_host(host, src)
        b = runtime.copy_to_device(back, host2)
        a.wait()
        b.wait()

    duplex = 2 * nbytes / timed(both)
    out = {"d2h": d2h, "h2d": h2d, "duplex": duplex, "nvme_write": 0.0, "nvme_read": 0.0}
    if shares:
        out["compute_share_during_copies"] = compute_share_during_copies(
            # fetch_to_device: the compute stream must not wait for the copy (copy_to_device makes it), or the
            # chain would run after the copy rather than beside it, and the share measure that wait.
            device, lambda: (runtime.copy_to_host(host, src), runtime.fetch_to_device(back, host2)),
            nbytes / min(d2h, h2d))
    return out


def compute_share_during_copies(device: torch.device, start_copies: Any, copy_seconds: float,
                                repeats: int = 3) -> float:
    """The device's matmul speed while ``start_copies()`` (both directions) run, over its speed alone: a chain of
    matmuls about as long as one copy, best of ``repeats`` each way; clamped to [1/20, 1] (noise can make the
    busy chain the faster)."""
    cuda = device.type == "cuda"
    n = 4096 if cuda else 192
    # Never from the RNG (the user's dropout masks must not move); bf16 on a GPU, as training's matmuls run there.
    a = torch.full((n, n), 1.0 / n, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    c = torch.empty_like(a)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the compute stream only, not the copies'

    def chain(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            torch.mm(a, a, out=c)
        sync()
        return time.perf_counter() - t0

    chain(1)  # warm-up
    one = min(chain(1) for _ in range(repeats))
    k = max(1, min(64, round(copy_seconds / max(one, 1e-9))))
    alone = min(chain(k) for _ in range(repeats))

    def busy() -> float:
        copies = start_copies()
        t = chain(k)
        for x in copies:
            x.wait()
        return t

    with_copies = min(busy() for _ in range(repeats))
    return min(1.0, max(0.05, alone / with_copies))
