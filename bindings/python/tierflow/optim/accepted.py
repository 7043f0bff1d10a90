"""What CPUAdamW accepts: the optimizers tierflow.wrap replaces by it, and the gradient dtypes its kernels take."""

from __future__ import annotations

import torch

from .. import _C

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
