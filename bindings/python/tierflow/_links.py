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


def measure_links(runtime: Any, device: torch.device, nbytes: Optional[int] = None) -> dict:
    """Copy bandwidths between this device and pinned host memory, in bytes/s, through tierflow's copy engine.

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
    return {"d2h": d2h, "h2d": h2d, "duplex": duplex, "nvme_write": 0.0, "nvme_read": 0.0}
