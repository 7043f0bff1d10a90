"""DDP's reduced gradients fed to the CPU optimizer's gradient stream (Note [Distributed training] in
_distributed.py; the C++ side: bindings/src/grad_stream_reduced.cpp).

tierflow registers one communication hook on the DDP module (ddp.register_comm_hook). Per bucket it
reduces as DDP's own reduction does (each gradient times 1 / world size, then an all-reduce sum; with
gradient_as_bucket_view=True a division, as DDP does then) and, in the callback of the all-reduce's
future, hands the reduced bucket to the gradient stream, which copies each carried parameter's slice to
the host and steps it while backward goes on. A hook the user registers later (ddp.register_comm_hook
after tierflow saw the DDP) runs in place of that reduction, and what its future holds streams: it is
what DDP writes into p.grad. Nothing here runs per parameter but the list DDP's bucket builds. What is decided
(the bucket's scaling, whether tierflow can feed, the refusals) is decided torch-free: Note [Rank decisions under
DDP] in optimizer/distributed_ranks.hpp (_C.distributed).
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
        self.as_view = bool(ddp.gradient_as_bucket_view)  # DDP divides in place then, multiplies by 1/n otherwise
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
    divide, factor = _C.distributed.ddp_bucket_scaling(feed.as_view, world)
    if divide:
        buffer.div_(world)  # factor == world
    else:
        buffer.mul_(factor)
    return dist.all_reduce(buffer, group=feed.group, async_op=True).get_future().then(fed)


def _refuse_uneven_divisor(ddp: Optional[torch.nn.Module]) -> None:
    """DDP's join(divide_by_initial_world_size=False): refused (its divisor is told to DDP's own reduction only)."""
    config = getattr(ddp, "_join_config", None)
    why = _C.distributed.ddp_join_divisor_refusal(config is not None and bool(config.enable),
                                                  bool(getattr(ddp, "_divide_by_initial_world_size", True)))
    if why is not None:
        raise _C.TierflowError(why)


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
    return _C.distributed.ddp_feed_refusal(_registered_hook(ddp) or "", getattr(ddp, "_tierflow_feed", None) is not None,
                                           bool(getattr(ddp, "_use_python_reducer", False)))


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
            raise RuntimeError(_C.distributed.ddp_second_hook_refusal(getattr(state.user[0], '__qualname__', '?')))
        state.user = (hook, state_of_hook)
        module._comm_hooks.append((hook, state_of_hook))
        if module.logger is not None:
            module.logger._set_comm_hook_name(getattr(hook, "__qualname__", repr(hook)))

    return register_comm_hook


def _refusing_builtin(comm_hook_type: Any) -> None:
    raise _C.TierflowError(_C.distributed.ddp_builtin_hook_refusal(str(comm_hook_type)))
