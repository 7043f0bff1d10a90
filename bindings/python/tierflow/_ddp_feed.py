"""DDP's reduced gradients fed to the CPU optimizer's gradient stream (Note [Distributed training] in
_distributed.py; the C++ side: bindings/src/grad_stream_reduced.cpp).

tierflow registers one communication hook on the DDP module (ddp.register_comm_hook). Per bucket it
reduces as DDP's own reduction does (each gradient times 1 / world size, then an all-reduce sum; with
gradient_as_bucket_view=True a division, as DDP does then) and, in the callback of the all-reduce's
future, hands the reduced bucket to the gradient stream, which copies each carried parameter's slice to
the host and steps it while backward goes on. A hook the user registers later (ddp.register_comm_hook
after tierflow saw the DDP) runs in place of that reduction, and what its future holds streams: it is
what DDP writes into p.grad. Nothing here runs per parameter but the list DDP's bucket builds.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from . import _C


class ReducedFeed:
    """The state of tierflow's hook on one DDP module: the optimizer it feeds, and the user's hook, if any."""

    def __init__(self, ddp: torch.nn.Module, optimizer: Any) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.ddp = weakref.ref(ddp)
        self.group = ddp.process_group
        self.divide = bool(ddp.gradient_as_bucket_view)  # DDP divides in place then, multiplies by 1/n otherwise
        self.user: Optional[tuple] = None  # (hook, state) registered after tierflow's

    def stream(self) -> Any:
        opt = self.optimizer()
        streaming = opt.streaming if opt is not None else None
        return streaming.stream if streaming is not None and opt.steps_during_backward() else None


def tierflow_reduce_and_stream(feed, bucket):  # no annotations: DDP's _check_comm_hook compares them with its types
    """The communication hook (a ReducedFeed, a torch.distributed.GradBucket -> a Future of the reduced bucket):
    the bucket's reduction (DDP's, or the user's hook), then its result streams."""
    params = bucket.parameters()
    _refuse_uneven_divisor(feed.ddp())
    # DDP's join() runs the hook outside any backward, on zeros, for a rank that ran out of inputs: nothing streams.
    in_backward = torch._C._current_graph_task_id() != -1

    def fed(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        reduced = value[0] if isinstance(value, list) else value
        stream = feed.stream() if in_backward else None
        if stream is not None and isinstance(reduced, torch.Tensor) and reduced.layout == torch.strided:
            stream.on_reduced(params, reduced)
        return reduced

    if feed.user is not None:
        hook, state = feed.user
        return hook(state, bucket).then(fed)
    dist = torch.distributed
    buffer = bucket.buffer()
    world = feed.group.size() if feed.group is not None else dist.get_world_size()
    if feed.divide:
        buffer.div_(world)
    else:
        buffer.mul_(1.0 / world)
    return dist.all_reduce(buffer, group=feed.group, async_op=True).get_future().then(fed)


def _refuse_uneven_divisor(ddp: Optional[torch.nn.Module]) -> None:
    """DDP's join(divide_by_initial_world_size=False) divides by the ranks that have not joined, which DDP tells
    its own reduction only: tierflow's hook, like any, divides by the world size."""
    config = getattr(ddp, "_join_config", None)
    if config is not None and config.enable and not getattr(ddp, "_divide_by_initial_world_size", True):
        raise _C.TierflowError(
            "tierflow: DistributedDataParallel.join(divide_by_initial_world_size=False) under tierflow: DDP then "
            "divides each gradient by the number of ranks that have not joined, which it tells its own reduction "
            "only, and tierflow reduces through a DDP communication hook (to step during backward from the reduced "
            "gradients), which divides by the world size; accepted: join() with divide_by_initial_world_size=True "
            "(the default), or TIERFLOW_OVERLAP_STEP=off (overlap_step='off'; DDP then reduces by itself)")


def _registered_hook(ddp: torch.nn.Module) -> Optional[str]:
    """The name of the communication hook registered on ``ddp`` already, if any (a Python or a built-in one)."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if hooks:
        hook = hooks[0][0]
        return getattr(hook, "__qualname__", None) or repr(hook)
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except Exception:  # an older or newer DDP without the logging data: hooks are seen in _comm_hooks only
        name = None
    return str(name) if name else None


def why_not_fed(ddp: torch.nn.Module) -> Optional[str]:
    """Why tierflow cannot feed the reduced gradients of ``ddp`` (None: it can)."""
    existing = _registered_hook(ddp)
    if getattr(ddp, "_tierflow_feed", None) is not None:
        return None  # ours, from an earlier session: it feeds the new optimizer
    if existing:
        return (f"a DDP communication hook is registered on it already ({existing}; DDP's mixed_precision and "
                "optimizer-in-backward register one too), and DDP takes one only; register yours after "
                "tierflow.wrap has seen the DDP module (tierflow then runs it and steps from what it returns)")
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP runs its Python reducer (compiled autograd), which calls hooks per parameter"
    return None


def feed(ddp: torch.nn.Module, optimizer: Any) -> None:
    """Registers tierflow's hook on ``ddp`` (why_not_fed must be None) for ``optimizer``'s stream; a later
    ddp.register_comm_hook composes with it, a built-in hook is refused with an error that says so."""
    params = [p for p in ddp._module_parameters if p.requires_grad]
    optimizer.streaming.stream_reduced(params)
    state = getattr(ddp, "_tierflow_feed", None)
    if state is not None:
        state.optimizer = weakref.ref(optimizer)
        return
    state = ReducedFeed(ddp, optimizer)
    type(ddp).register_comm_hook(ddp, state, tierflow_reduce_and_stream)
    ddp._tierflow_feed = state
    ddp.register_comm_hook = _composing(ddp, state)
    ddp._register_builtin_comm_hook = _refusing_builtin


def _composing(ddp: torch.nn.Module, state: ReducedFeed) -> Callable:
    ref = weakref.ref(ddp)

    def register_comm_hook(state_of_hook: object, hook: Callable) -> None:
        """DDP's register_comm_hook, on a DDP module whose gradients tierflow streams: the hook runs inside
        tierflow's (in place of its all-reduce) and what its future holds streams to the CPU optimizer."""
        module = ref()
        module._check_comm_hook(hook)
        if state.user is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once "
                               f"(a hook is registered already: {getattr(state.user[0], '__qualname__', '?')})")
        state.user = (hook, state_of_hook)
        module._comm_hooks.append((hook, state_of_hook))
        if module.logger is not None:
            module.logger._set_comm_hook_name(getattr(hook, "__qualname__", repr(hook)))

    return register_comm_hook


def _refusing_builtin(comm_hook_type: Any) -> None:
    raise _C.TierflowError(
        f"DistributedDataParallel._register_builtin_comm_hook({comm_hook_type}) after tierflow.wrap: tierflow "
        "registered its own DDP communication hook, which streams the reduced gradients to its CPU optimizer, and "
        "DDP takes one only; accepted: a Python hook through ddp.register_comm_hook(state, hook) (tierflow runs it "
        "in place of its all-reduce), or a built-in hook registered before tierflow.wrap (tierflow's CPU optimizer "
        "then steps after backward)")
