"""What CPUAdamW accepts: the optimizers tierflow.wrap replaces by it, the gradient dtypes its kernels take, and
FSDP2's shards (all of its parameters or none, with the settings they take)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _C
from .copies import local_shard

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_grad(grad: torch.Tensor) -> None:
    """Refuses a gradient the CPU kernels cannot take, naming what they accept."""
    if grad.is_sparse or grad.dtype not in GRAD_DTYPES:
        raise _C.TierflowError(f"tierflow CPUAdamW: a {'sparse ' if grad.is_sparse else ''}{grad.dtype} gradient "
                               "is not supported; accepted: dense float32, bfloat16 or float16")


def check_replaceable(optimizer: torch.optim.Optimizer) -> None:
    """Accepts exactly ``torch.optim.AdamW`` and ``torch.optim.Adam``; anything
    else (another algorithm, or a subclass that may change ``step``) raises
    ``TierflowError`` naming it and what is accepted.
    """
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        cls_ = type(optimizer)
        public = getattr(torch.optim, cls_.__name__, None) is cls_
        name = f"torch.optim.{cls_.__name__}" if public else f"{cls_.__module__}.{cls_.__qualname__}"
        raise _C.TierflowError(
            f"tierflow.wrap: cannot replace an optimizer of type {name}; "
            "accepted: torch.optim.AdamW, torch.optim.Adam. "
            "Pass offload_optimizer='none' to keep your optimizer on the device.")
    for i, g in enumerate(optimizer.param_groups):
        if g.get("differentiable"):
            raise _C.TierflowError(f"tierflow.wrap: param group {i} has differentiable=True, "
                                   "which the CPU optimizer cannot honour; accepted: differentiable=False")
        for p in g["params"]:
            if not p.is_floating_point() or p.dtype not in GRAD_DTYPES:
                raise _C.TierflowError(f"tierflow.wrap: param group {i} holds a parameter of dtype {p.dtype}; "
                                       "accepted: float32, bfloat16, float16")


def check_sharding(param_groups: list, names: dict, runtime: "_C.Runtime", cfg: Any) -> bool:
    """Whether the parameters of ``param_groups`` are FSDP2's DTensor shards (each rank steps its own: Note
    [Distributed training]); raises for a mix of shards and plain parameters (the plain ones' gradients are not
    reduced across ranks, and one norm cannot be taken over both; ``names``: id(p) -> its name, for the message)
    and for the settings the shards do not take."""
    params = [p for g in param_groups for p in g["params"]]
    sharded = [p for p in params if local_shard(p) is not p]
    plain = [names.get(id(p), f"a parameter of shape {list(p.shape)}") for p in params if local_shard(p) is p]
    # Shards in host memory while tierflow's device is CUDA (FSDP2's CPUOffloadPolicy; wrap reads the policy
    # itself from the model, which a CPUAdamW made directly does not have): refused as that policy is.
    host_shards = runtime.device == "cuda" and any(local_shard(p).device.type == "cpu" for p in sharded)
    why = _C.shards_refusal(cfg, len(sharded), len(params), plain if sharded else [], host_shards)
    if why:
        raise _C.ConfigError(why)
    return bool(sharded)
