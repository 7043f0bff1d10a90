"""What CPUAdamW moves between the runtime's device and pinned host memory.

Note [Optimizer copies]
~~~~~~~~~~~~~~~~~~~~~~~
Every gradient, parameter and master that moves between the runtime's device
and the host goes through tierflow's copy engine, on CUDA and on the emulated
device alike, so the adversarial emulated device checks this path too
(Note [Copy ordering] in swap/include/tierflow/swap/copy_engine.hpp):
- a gradient is copied to pinned memory after the work queued on the current
  stream: in a post-accumulate-grad hook (C++ for device parameters: its slice
  of a bucket) that is the stream backward produced it on; the CPU step waits
  for the copy before it reads the gradient, and the device gradient is kept
  referenced until then (with TIERFLOW_OFFLOAD_GRADIENTS=on p.grad is None at
  once and that reference, the last, goes right then: Note [Gradient
  streaming]);
- an updated parameter goes back from pinned staging after the work queued on
  the current stream (kernels still reading the old value), the stream waits
  for it before its next kernel, and step() waits for every upload before the
  staging returns to the pool;
- a parameter that lives on the host or NVMe between uses
  (TIERFLOW_OFFLOAD_PARAMS, Note [Parameter hooks]) is read from and written
  to its home there, never the device: the next forward fetches it.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from .. import _C

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Note [Optimizer state formats] (optimizer/state_format.hpp): the format of a moment is its dtype. A bf16 moment
# is shaped like its parameter (or shard); an 8-bit one is ONE uint8 tensor of _C.moment_bytes("8bit", numel)
# bytes: the codes, padded to 16 bytes, then the fp32 scales (_C.moment_layout).
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}
#: The format of a moment tensor, from its dtype: "fp32", "bf16", "8bit", or None for another dtype (one rule, the
#: C++ one: bindings/src/runtime.cpp's moment_format).
moment_format = _C.moment_format


def host_moment(runtime: "_C.Runtime", like: torch.Tensor, fmt: str) -> torch.Tensor:
    """A fresh moment (exp_avg or exp_avg_sq) in format ``fmt`` for a parameter or shard shaped like ``like``,
    zeroed in the pinned host pool: float32 or bfloat16 of like's shape, or the one uint8 buffer of an 8-bit
    moment (all zero: codes 0 and scales 0 decode to 0)."""
    return runtime.host_moment(list(like.shape), fmt)


def moment_views(moment: torch.Tensor, like: torch.Tensor) -> tuple:
    """An 8-bit moment's (codes shaped like ``like``, fp32 scales [blocks]): views of its buffer, no copy."""
    numel = like.numel()
    offset, blocks = _C.moment_layout(numel)
    return moment[:numel].view(like.shape), moment[offset:offset + 4 * blocks].view(torch.float32)


def packed_moment(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """The one-buffer 8-bit moment of ``codes`` (uint8, any shape) and ``absmax`` (its fp32 scales): a new CPU
    tensor (moment_views' inverse); padding zero."""
    numel = codes.numel()
    offset, blocks = _C.moment_layout(numel)
    if codes.dtype != torch.uint8 or absmax.numel() != blocks:
        raise _C.TierflowError(f"tierflow CPUAdamW: an 8-bit moment of {numel} elements takes uint8 codes and "
                               f"{blocks} fp32 scales (exp_avg_absmax); got {codes.dtype} codes and "
                               f"{absmax.numel()} scales")
    out = torch.zeros(_C.moment_bytes("8bit", numel), dtype=torch.uint8)
    out[:numel].copy_(codes.reshape(-1))
    out[offset:].view(torch.float32).copy_(absmax.reshape(-1).to(torch.float32))
    return out


def local_shard(t: Any) -> Any:
    """An FSDP2 parameter or gradient (a DTensor): this rank's shard, a plain tensor over the DTensor's own
    storage, what tierflow's CPU optimizer steps (Note [Distributed training]); any other tensor as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        with torch.no_grad():  # to_local() under no_grad is the shard itself, not a view through autograd
            return t.to_local()
    return t


class DeviceCopies:
    """The optimizer's copies through the runtime's copy engine, and the uploads not yet waited for."""

    def __init__(self, runtime: "_C.Runtime") -> None:
        self._runtime = runtime
        self._pending_uploads: list = []  # (transfer, staging) of parameters on their way to the device
        self.homes: Any = None  # the ParamOffload of parameters kept on the host between uses, if any

    def home(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """p's host copy when p lives on the host between uses (then the optimizer's parameter), else None."""
        return self.homes.host_copy(p) if self.homes is not None else None

    def offloaded(self, p: torch.Tensor) -> bool:
        """True when p lives on the host or NVMe between uses."""
        return self.homes is not None and self.homes.offloaded(p)

    def source(self, p: torch.Tensor) -> torch.Tensor:
        """Where p's current value can be read: its host copy, a read from NVMe, or p."""
        return self.homes.load(p) if self.offloaded(p) else p.detach()

    def host(self, like: torch.Tensor, zero: bool) -> torch.Tensor:
        """A pinned fp32 tensor of ``like``'s shape (zeroed when ``zero``)."""
        return self._runtime.host_empty(list(like.shape), "float32", zero)

    def host_moment(self, like: torch.Tensor, fmt: str) -> torch.Tensor:
        """A zeroed pinned moment in format ``fmt`` for ``like`` (host_moment)."""
        return host_moment(self._runtime, like, fmt)

    def staging(self, p: torch.Tensor, flat: bool = False) -> torch.Tensor:
        """A pinned tensor of p's dtype and shape (one dimension when ``flat``) for its new value."""
        return self._runtime.host_empty([p.numel()] if flat else list(p.shape), DTYPE_NAMES[p.dtype], False)

    def staged(self, t: torch.Tensor) -> bool:
        """True when ``t`` is on the runtime's device and moves through the copy engine."""
        return self._runtime.on_device(t)

    def fetch(self, t: torch.Tensor) -> tuple:
        """Starts a copy of device tensor ``t`` into pinned memory: (host tensor, transfer, source).

        The host tensor has t's dtype and shape; wait on the transfer before
        reading it, and keep the source referenced until then.
        """
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()  # on the current stream, so the copy is ordered after it
        host = self._runtime.host_empty(list(src.shape), DTYPE_NAMES[src.dtype], False)
        return host, self._runtime.copy_to_host(host, src), src

    def read_into(self, dst: torch.Tensor, t: torch.Tensor) -> None:
        """dst (a host tensor) <- t, converting the dtype on the host."""
        if self.offloaded(t):
            dst.copy_(self.homes.load(t).view(dst.shape))
        elif self.staged(t):
            host, transfer, _src = self.fetch(t)
            transfer.wait()
            dst.copy_(host.view(dst.shape))
        else:
            dst.copy_(t.detach())

    def write_param(self, p: torch.Tensor, host: torch.Tensor) -> None:
        """p <- host (pinned, p's dtype): through the copy engine for a device parameter."""
        if self.offloaded(p):
            self.homes.store(p, host.view(p.shape))  # nothing to copy when host is p's host copy
        elif self.staged(p) and p.is_contiguous():
            transfer = self._runtime.copy_to_device(p.detach(), host.view(p.shape))
            self._pending_uploads.append((transfer, host))
        else:
            p.detach().copy_(host.view(p.shape))

    def bump_offloaded_versions(self, param_groups: list) -> None:
        """A step wrote the host copies (or NVMe) of parameters off the device, not the parameters: their
        version counters move as an in-place step's would, so a graph saved before the step and run after it
        raises as in torch."""
        if self.homes is None:
            return
        for group in param_groups:
            for p in group["params"]:
                if self.homes.offloaded(p):
                    torch.autograd.graph.increment_version(p)

    def finish_uploads(self) -> None:
        """Waits for every parameter upload; only then may their staging return to the pool."""
        uploads, self._pending_uploads = self._pending_uploads, []
        for transfer, _host in uploads:
            transfer.wait()
