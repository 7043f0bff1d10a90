"""One forward of one block under its plan (Note [Activation plans] in runner.py): what each tensor it saves
becomes (kept, swapped to the block's tier, or a placeholder the replay resolves), and the replay that rebuilds
the dropped ones in backward by running the block's recorded ops again. runner.py's BlockRunner makes a Frame per
forward from its hooks on the block; the frame never decides a plan, it carries out the one it is given."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .. import _C, _trace
from .._param_casts import SavedCast, saved_cast
from .table import TRANSPARENT_OPS, Recorder, Saved, Table, row_suffix_matmul, storage_key
from .side_effects import BlockState

if TYPE_CHECKING:
    from .runner import BlockRunner

_local = threading.local()  # .replaying: a replay runs on this thread (hooks stand aside)


def replaying() -> bool:
    return getattr(_local, "replaying", False)



# Note [Data-dependent blocks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A block is recomputed from the table its first forward recorded, which holds
# only while the block runs the same ops for the same input shapes. A mixture of
# experts does not (Mixtral: which tokens reach which expert, and so the shapes
# it saves, change every step), nor does any block that branches on its data.
# Such a forward is found out while it runs: it saves a tensor of another shape
# or dtype than its table, or more or fewer tensors. It cannot be replayed, so
# from the tensor that departs on, everything it saves is swapped whole to the
# block's tier (parameters and buffers kept by reference), and the tensors it
# had left to the replay before that point (held by the frame until its forward
# ends, which costs no memory that the block's backward would not hold anyway)
# are swapped whole when it ends. The block then runs every later forward that
# way (no table, no replay, so a cache argument is fine too), and says so once,
# naming the block and what departed. The run never fails for it and stays bit
# for bit the baseline's (the zoo's Mixtral under every mode). A replay that
# runs other ops with every saved shape matching still raises, naming the block.


# ---- one forward of one block -----------------------------------------------------------


class BackwardClock:
    """A timing step's start of one forward's backward, shared by the gradient hooks that mark it: they hold
    this, not the Frame (whose runner leads to the runtime: BlockRunner._backward_mark)."""

    __slots__ = ("t0", "wait0", "replay")

    def __init__(self) -> None:
        self.t0: Optional[float] = None  # when the gradient of its output was ready
        self.wait0 = 0.0                 # the device wait just before t0
        self.replay = 0.0                # its replay's time (the frame may be gone when its backward ends)


class Placeholder:
    """What autograd holds for a saved tensor the replay rebuilds."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: "Frame", index: int) -> None:
        self.frame = frame
        self.index = index


class Swapped:
    """What autograd holds for a saved tensor the offloader moved whole."""

    __slots__ = ("runtime", "handle")

    def __init__(self, runtime: Any, handle: Any) -> None:
        self.runtime = runtime
        self.handle = handle


class Frame:
    """The state of one forward of one block, alive while autograd holds its saved tensors."""

    def __init__(self, runner: "BlockRunner", table: Table, recording: bool) -> None:
        self.runner = runner
        self.table = table
        self.recording = recording
        # A recording forward has no table to split by yet: it recomputes instead.
        self.mode = "recompute" if recording and runner.mode == "split" else runner.mode
        self.tier = runner.tier
        self.packs = 0
        self.args: Any = None         # (args, kwargs), swapped tensors as ("__tierflow_swapped__", handle)
        self.rng: Any = None
        self.autocast: Any = None
        self.device: Optional[torch.device] = None
        self.whole: dict = {}         # (op, out) -> offloader handle of an attention output
        self.prefix: dict = {}        # op -> offloader handle of a split output's first rows
        self.rows: dict = {}          # op -> r0
        self.resolved: dict = {}      # pack index -> tensor, after a replay
        self._actions: Optional[list] = None  # table.actions(mode), looked up once per forward
        self.external: set = set()    # storage keys of the block's parameters and buffers
        # Note [Data-dependent blocks]: a forward that departs from its table swaps its saved tensors whole.
        self.dynamic: Optional[str] = None  # why this forward is not its table's
        self.pending: dict = {}       # pack index -> the tensor behind a placeholder, until the forward ends
        self.whole_swapped: dict = {}  # pack index -> offloader handle, for placeholders of a departed forward
        self.backward_clock = BackwardClock()     # timing step: its backward's start (BlockRunner._backward_mark)
        self.t0 = 0.0                              # timing step: when its forward began
        self.wait0 = 0.0                           # timing step: the device wait just before t0
        self.replay_seconds = 0.0                  # timing step: its replay's time
        self.input_swap = 0.0                      # timing step: its inputs' swap before its forward
        self.wait_before_inputs = 0.0              # timing step: the device wait just before that swap
        self.state: Optional[BlockState] = None    # Note [Replay side effects]: what a replay restores

    # -- forward ---------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        i = self.packs
        self.packs += 1
        if self.recording:
            return self._pack_recording(i, t)
        if self.dynamic is not None:
            return self._pack_whole(t)
        table = self.table
        if i >= len(table.saved):
            return self.depart(f"saved more tensors than its recorded forward ({len(table.saved)})", t)
        s = table.saved[i]
        if tuple(t.shape) != s.sizes or t.dtype != s.dtype:
            return self.depart(f"saved tensor {i} is {tuple(t.shape)} {t.dtype}, recorded {s.sizes} {s.dtype}", t)
        return self._pack_planned(i, s, t)

    def _pack_whole(self, t: torch.Tensor) -> Any:
        if storage_key(t) in self.external:
            return t
        return self._to_tier(t)

    def _to_tier(self, t: torch.Tensor) -> Any:
        """A saved tensor that leaves the device: to the block's tier, or a recipe when it is a cast of an
        offloaded parameter (Note [Parameter casts])."""
        cast = saved_cast(t)
        if cast is not None:
            return cast
        rt = self.runner.runtime
        return Swapped(rt, rt.pack_to(t, self.tier))

    def depart(self, why: str, t: Optional[torch.Tensor] = None) -> Any:
        """This forward is not its table's (Note [Data-dependent blocks]): the rest is swapped whole, and what
        was left to the replay is swapped whole when the forward ends (finish)."""
        self.dynamic = why
        self.runner.fall_back(why)
        return self._pack_whole(t) if t is not None else None

    def not_replayed(self, why: str) -> None:
        """This forward may not be replayed (Note [Replay side effects]): what it left to the replay is swapped
        whole when it ends (finish), as a departed forward's; the block's later forwards are not affected."""
        self.dynamic = why

    def finish(self) -> None:
        """The block's forward ended: placeholders of a departed forward get their tensors swapped whole."""
        if self.dynamic is None and not self.recording and self.table is not None \
                and self.packs != len(self.table.saved):
            self.depart(f"saved {self.packs} tensors, its recorded forward {len(self.table.saved)}")
        if self.dynamic is not None:
            rt = self.runner.runtime
            for i, t in self.pending.items():
                self.whole_swapped[i] = rt.pack_to(t, self.tier)
        self.pending.clear()

    def _pack_planned(self, i: int, s: Saved, t: torch.Tensor) -> Any:
        rt = self.runner.runtime
        if self._actions is None:
            self._actions = self.table.actions(self.mode)
        action = self._actions[i]
        if action == "reference":
            return t
        if action == "swap":
            if self.table.classes[i] != "attention":
                return self._to_tier(t)
            h = rt.pack_to(t, self.tier)
            self.whole[(s.op, s.out)] = h
            return Swapped(rt, h)
        if action == "swap_rows" and s.op not in self.prefix:
            r0 = self.table.exact_rows[s.op]
            o = self.table.ops[s.op].outputs[s.out]
            base = t.new_empty(0).set_(t.untyped_storage(), o[2], o[0], o[1])
            self.prefix[s.op] = rt.pack_to(base[:r0].clone(), self.tier)
            self.rows[s.op] = r0
        self.pending[i] = t  # until the forward ends: a departure from the table needs it (finish)
        return Placeholder(self, i)

    def _pack_recording(self, i: int, t: torch.Tensor) -> Any:
        rec: Recorder = self.recorder
        k = storage_key(t)
        s = Saved(sizes=tuple(t.shape), strides=tuple(t.stride()), offset=t.storage_offset(), dtype=t.dtype)
        cls = "external"
        if k in rec.inputs:
            cls = "input"
        elif k in rec.producer and k not in self.external:
            # Its class follows the producing op; a matmul output written in place since the matmul is cheap
            # (tiering::BlockTable::add_produced, Note [Block table]).
            s.op, s.out = rec.producer[k]
            cls = "produced"
        # Addresses are reused once a dropped tensor is freed: a storage is its address and producer.
        first = (k, s.op) not in self.seen
        self.seen.add((k, s.op))
        rec.table.add_saved(s, cls, t.untyped_storage().nbytes(), first, mutated=k in rec.mutated)
        # No table yet: the recording forward runs the swap or the recompute plan, which need none.
        if cls == "external":
            return t
        if self.mode == "swap" or cls == "input":
            return self._to_tier(t)
        self.pending[i] = t  # until the forward ends: one that may not be replayed needs it (not_replayed)
        return Placeholder(self, i)

    # -- backward --------------------------------------------------------------------
    def unpack(self, p: Placeholder) -> torch.Tensor:
        if p.index in self.whole_swapped:
            return self.runner.runtime.unpack(self.whole_swapped.pop(p.index))
        if p.index not in self.resolved:
            self.replay()
        return self.resolved.pop(p.index)

    def replay(self) -> None:
        runner = self.runner
        rt = runner.runtime
        t0 = time.perf_counter() if runner.timing else 0.0

        restored: dict = {}  # id(marker) -> tensor: one tensor for an argument the forward got twice

        def restore(a: Any) -> Any:
            if isinstance(a, tuple) and len(a) == 2 and a[0] == "__tierflow_swapped__":
                if id(a) not in restored:
                    t = rt.unpack(a[1]).detach()
                    restored[id(a)] = t.requires_grad_(True) if a[1] is not None and t.is_floating_point() else t
                return restored[id(a)]
            return a

        args, kwargs = tree_map(restore, self.args, is_leaf=lambda a: isinstance(a, tuple) and len(a) == 2
                                and a[0] == "__tierflow_swapped__")
        mode = Replay(self)
        devices = [self.device.index or 0] if self.device is not None and self.device.type == "cuda" else []
        _local.replaying = True
        try:
            with _trace.span(_trace.Lane.replay, f"block {runner.index} replay", block=runner.index), \
                    torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
                torch.set_rng_state(self.rng[0])
                if devices:
                    torch.cuda.set_rng_state(self.rng[1], self.device)
                dev_type, enabled, dtype, cache = self.autocast
                # Note [Replay side effects]: the state the forward started from, outside the op walk.
                with self.state.restored() if self.state is not None else _nothing(), torch.enable_grad(), \
                        torch.autocast(dev_type, dtype=dtype, enabled=enabled, cache_enabled=cache), \
                        torch.autograd.graph.saved_tensors_hooks(alias, identity), mode:
                    runner.module(*args, **kwargs)
        finally:
            _local.replaying = False
        if mode.j != len(self.table.ops):
            raise _C.TierflowError(runner.mismatch(f"its replay ran {mode.j} ops, its forward {len(self.table.ops)}"))
        actions = self.table.actions(self.mode)
        for i, s in enumerate(self.table.saved):
            if actions[i] in ("reference", "swap"):
                continue
            base = mode.outputs[(s.op, s.out)]
            self.resolved[i] = base.new_empty(0).set_(base.untyped_storage(), s.offset, s.sizes, s.strides).detach()
        runner.replays += 1
        if self.state is not None and (self.state.copies or self.state.rebound):
            runner.restores += 1
        if runner.timing:
            runner.sync()
            self.replay_seconds = time.perf_counter() - t0
            self.backward_clock.replay = self.replay_seconds
            runner.recompute_seconds.append(self.replay_seconds)


class Replay(TorchDispatchMode):
    """Runs a block's recorded ops again (Note [Activation plans])."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame
        self.j = 0
        self.outputs: dict = {}
        needed = {(s.op, s.out) for s in frame.table.saved if s.op >= 0}
        self.needed_ops = {op for op, _ in needed}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in TRANSPARENT_OPS:
            return func(*args, **kwargs)
        f = self.frame
        j = self.j
        self.j += 1
        ops = f.table.ops
        if j >= len(ops) or ops[j].func is not func:
            raise _C.TierflowError(f.runner.mismatch(
                f"its replay ran {func} as op {j}, its forward {ops[j].func if j < len(ops) else 'nothing'}"))
        op = ops[j]
        rt = f.runner.runtime
        if f.mode == "split" and j in f.table.restorable:
            outs = []
            for k, meta in enumerate(op.outputs):
                if meta[0] == "value":
                    outs.append(meta[1])
                elif (j, k) in f.whole:
                    r = rt.unpack(f.whole[(j, k)])
                    outs.append(r.new_empty(0).set_(r.untyped_storage(), meta[2], meta[0], meta[1]))
                else:  # an empty output (nothing to save)
                    outs.append(torch.empty(meta[0], dtype=meta[3], device=args[0].device))
            out = tuple(outs) if len(outs) > 1 else outs[0]
            f.runner.restored_ops += 1
        elif j in f.rows:
            out = row_suffix_matmul(func, args, kwargs, f.rows[j], rt.unpack(f.prefix[j]))
            f.runner.split_rows += f.rows[j]
        else:
            out = func(*args, **kwargs)
        if j in self.needed_ops:
            flat = out if isinstance(out, (tuple, list)) else (out,)
            for k, o in enumerate(flat):
                if isinstance(o, torch.Tensor):
                    self.outputs[(j, k)] = o
        return out


def identity(t: Any) -> Any:
    """The unpack hook of what alias packed."""
    return t


def alias(t: torch.Tensor) -> torch.Tensor:
    """A pack hook that keeps ``t`` where it is (Note [Saved-tensor hook aliases] in runner.py)."""
    return t.detach()


def unpack_saved(packed: Any) -> torch.Tensor:
    """The unpack hook of a Frame's saved tensors: a placeholder's (replayed), a swapped one's, a cast's."""
    if isinstance(packed, Placeholder):
        return packed.frame.unpack(packed)
    if isinstance(packed, Swapped):
        return packed.runtime.unpack(packed.handle)
    if isinstance(packed, SavedCast):
        return packed.materialize()
    return packed


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()
