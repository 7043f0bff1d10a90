"""FSDP2's reduce-scattered gradients fed to the CPU optimizer's gradient stream (Note [Distributed training] in
_distributed.py; the C++ side: bindings/src/grad_stream_reduced.cpp, as for DDP).

FSDP2 assigns a unit's sharded gradients (DTensors) in the unit's post-backward, after its reduce-scatter, and no
autograd hook of the parameters sees that. Autograd's order shows the moment: FSDP2's pre-forward hook applies an
identity autograd function to the unit's inputs whose backward is that post-backward; tierflow's pre-forward hook,
put before FSDP2's, applies its own identity function to the same inputs first, so in backward tierflow's runs
right after FSDP2's post-backward of the unit. It hands each new local gradient (the DTensor's local tensor) to
the stream, which copies it to the host and steps the shard while backward goes on. A unit whose inputs need no
gradient (the root, fed token ids) reduces in FSDP2's final callback; a gradient hook on each unit's output,
registered after FSDP2's pre-backward hook (which queues that callback), queues tierflow's final callback after
FSDP2's. It feeds the rest, sets each carried shard's ``.grad`` to its gradient's local tensor (the gradient's
identity that step() and a clip check is the DTensor's with the version counters of both: GradStream::
add_fed_parameter) and queues the stream's end of backward after itself.

On CUDA the local gradient is ready on FSDP2's reduce-scatter stream, not the compute stream: the feed runs on a
stream of its own that waits for the unit's post-reduce event (FSDP2's private state: where it cannot be found,
nothing streams and step() steps the unit), so the stream's copies wait for it (rule 1 of Note [Copy ordering])
while the compute stream goes on, as under FSDP2 alone. Unmeasured on a GPU. Nothing here runs in a replay (a recompute inside
backward) or without autograd.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch

from .optim.copies import local_shard


class FsdpFeed:
    """The units of one FSDP2 model and the CPU optimizer their gradients feed (see the module doc)."""

    def __init__(self, optimizer: Any, units: list) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.units = units  # [(FSDP2 module, [its own parameters the stream carries])]
        self._fed: dict = {}  # id(parameter) -> (the gradient fed last, its versions then, its fingerprint)
        self._queued_in: Optional[int] = None  # the backward (graph task) tierflow's final callback is queued in
        self._side: dict = {}  # CUDA: per device, the stream the feed runs on (waits for FSDP2, not compute)
        self.handles: list = []

    def streaming(self) -> Any:
        opt = self.optimizer()
        if opt is None or not opt.steps_during_backward():
            return None
        return opt.streaming

    # -- backward -----------------------------------------------------------------
    def unit_reduced(self, index: int) -> None:
        """FSDP2's post-backward of unit ``index`` has run: its new gradients stream."""
        streaming = self.streaming()
        unit, params = self.units[index]
        if streaming is None or not params:
            return
        with self._feeding(unit, params) as ready:
            if ready:
                for p in params:
                    self._feed(streaming, p)

    def output_gradient(self, grad: torch.Tensor) -> None:
        """A unit's output gradient, after FSDP2's pre-backward hook queued its final callback: ours after it."""
        task = torch._C._current_graph_task_id()
        if self._queued_in != task and self.streaming() is not None:  # a backward that raised left it queued
            self._queued_in = task
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def end_of_backward(self) -> None:
        """After FSDP2's final callback: the units it reduced there stream, each shard's .grad is its gradient's
        local tensor, and the stream's end of backward comes after this."""
        self._queued_in = None
        streaming = self.streaming()
        if streaming is None:
            return
        for unit, params in self.units:
            with self._feeding(unit, params) as ready:  # FSDP2's finalize_backward waited: no event left
                if ready:
                    for p in params:
                        self._feed(streaming, p)
        self.sync_grads()
        streaming.stream.queue_backward_end()

    @contextlib.contextmanager
    def _feeding(self, unit: torch.nn.Module, params: list) -> Iterator[bool]:
        """Where a unit's gradients are read: on CUDA a stream of the feed's own that waits for the unit's
        reduce-scatter (_wait_post_reduce), so the compute stream keeps FSDP2's overlap; yields whether they can
        be (False: nothing of the unit streams, step() steps it)."""
        if not params or params[0].device.type != "cuda":
            yield True
            return
        device = params[0].device
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # what backward computed before this point too
        with torch.cuda.stream(side):
            yield _wait_post_reduce(unit, side)

    def _feed(self, streaming: Any, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        local = local_shard(grad)
        # The DTensor's version moves with an in-place op on it, its local tensor's with FSDP2's accumulation.
        version = grad._version + local._version
        fed = self._fed.get(id(p))
        if fed is not None and fed[0] is grad and fed[1] == version:
            return  # fed already (the root's, seen again at the end), or FSDP2 did not reduce it this backward
        shard = streaming.shard_of(p)
        if shard is None or not _same_memory(local_shard(p), shard) or local.shape != shard.shape:
            return  # FSDP2 gave the parameter a new local tensor: step() steps it from p.grad
        if local.is_cuda:  # read on the feed's stream: the allocator keeps its block until that work is done
            local.record_stream(torch.cuda.current_stream(local.device))
        self._fed[id(p)] = (grad, version, _fingerprint(local))  # held while p.grad holds it (sync_grads lets go)
        shard.grad = local
        if local.is_contiguous():
            streaming.stream.on_reduced([shard], local.view(-1))

    # -- what step(), zero_grad() and the user's clip ask ---------------------------------
    def refresh(self) -> None:
        """After a change the stream was shown (torch's clip, marked in clip.py): what was fed is what is there
        now, so that a later change no counter shows is found against it."""
        for _unit, params in self.units:
            for p in params:
                fed = self._fed.get(id(p))
                if fed is not None and p.grad is fed[0]:
                    local = local_shard(p.grad)
                    self._fed[id(p)] = (p.grad, p.grad._version + local._version, _fingerprint(local))

    def after_step(self) -> None:
        """step() confirmed this window: the shards let go of its gradients (model.zero_grad() does not reach
        them), and the next backward's are new."""
        self.join()
        self._fed.clear()
        opt = self.optimizer()
        streaming = opt.streaming if opt is not None else None
        if streaming is not None:
            for _unit, params in self.units:
                for p in params:
                    shard = streaming.shard_of(p)
                    if shard is not None:
                        shard.grad = None

    def join(self) -> None:
        """CUDA: the current stream waits for what the feed queued on its own (the fingerprints)."""
        for device, side in self._side.items():
            torch.cuda.current_stream(device).wait_stream(side)

    def remove(self) -> None:
        """unwrap: no more feeding (a CPUAdamW kept steps the shards in step())."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def mark_unseen_changes(self) -> int:
        """Before step() confirms: a gradient whose values changed since it streamed while neither version
        counter moved (DTensor's foreach ops move none: a GradScaler's unscale, a clip of the user's own) gets
        its version moved, so that step() steps it again from p.grad. Returns how many."""
        fed = [(p, f) for _unit, params in self.units for p in params
               if (f := self._fed.get(id(p))) is not None and p.grad is f[0]
               and f[0]._version + local_shard(f[0])._version == f[1]]
        self.join()
        if not fed:
            return 0
        with torch.no_grad():
            now = torch.stack([_fingerprint(local_shard(p.grad)) for p, _f in fed]).cpu()
            then = torch.stack([f[2] for _p, f in fed]).cpu()
        changed = [p for (p, _f), a, b in zip(fed, now, then) if not torch.equal(a, b)]
        for p in changed:
            torch.autograd.graph.increment_version(p.grad)
        return len(changed)


    def sync_grads(self) -> None:
        """Each carried shard's .grad is its parameter's gradient's local tensor, or None."""
        opt = self.optimizer()
        streaming = opt.streaming if opt is not None else None
        if streaming is None:
            return
        for _unit, params in self.units:
            for p in params:
                shard = streaming.shard_of(p)
                if shard is not None:
                    shard.grad = local_shard(p.grad) if p.grad is not None else None
                if p.grad is None:
                    self._fed.pop(id(p), None)


class _UnitReduced(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs right after FSDP2's post-backward of the unit."""

    @staticmethod
    def forward(ctx: Any, feed: Any, index: int, *inputs: torch.Tensor) -> Any:
        ctx.feed, ctx.index = feed, index
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        feed = ctx.feed()
        if feed is not None:
            feed.unit_reduced(ctx.index)
        return (None, None) + grads


def _wait_post_reduce(unit: torch.nn.Module, stream: Any) -> bool:
    """``stream`` waits for the unit's reduce-scatter and post-divide (FSDP2's post-reduce event), which its
    local gradients come from. False where the event cannot be found (FSDP2's internals moved: torch 2.13 keeps
    the unit's groups in _fsdp_param_groups, earlier ones one in _fsdp_param_group): then nothing of the unit
    streams and step() steps it."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    state = get_state() if get_state is not None else None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else None
    if groups is None or not all(hasattr(g, "_post_reduce_event") for g in groups):
        return False
    for group in groups:
        event = group._post_reduce_event
        if event is not None:
            stream.wait_event(event)
    return True


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _fingerprint(local: torch.Tensor) -> torch.Tensor:
    """The sum of a gradient's bit patterns, as integers (exact: one pass, no rounding, the same for the same
    values whatever the order), on its device: a change of it between the feed and step() is a change no
    version counter showed (mark_unseen_changes). Any change but one that keeps that sum (values swapped)."""
    with torch.no_grad():
        return local.view(_BITS[local.element_size()]).sum(dtype=torch.int64).reshape(1)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements (DTensor.to_local() gives a new alias each time)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def attach(model: torch.nn.Module, optimizer: Any, units: list) -> tuple:
    """Feeds ``optimizer``'s gradient stream from the FSDP2 ``units`` of ``model`` ([(module, params)]);
    returns the feed (its hooks: feed.handles)."""
    feed = FsdpFeed(optimizer, units)
    me = weakref.ref(feed)

    def pre_hook(index: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> Optional[tuple]:
            if not torch.is_grad_enabled() or _in_backward():
                return None
            at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            if not at:
                return None
            out = _UnitReduced.apply(me, index, *(args[i] for i in at))
            out = out if isinstance(out, tuple) else (out,)
            new = list(args)
            for i, t in zip(at, out):
                new[i] = t
            return tuple(new)
        return hook

    def post_hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled() or _in_backward():
            return
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(lambda g: (me() and me().output_gradient(g)) and None)
                return

    for index, (unit, _params) in enumerate(units):
        feed.handles.append(unit.register_forward_pre_hook(pre_hook(index), prepend=True))
        feed.handles.append(unit.register_forward_hook(post_hook))
    return feed


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
