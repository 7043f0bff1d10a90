"""Per-block activation plans: keep, swap, a token-wise split, or recompute.

Note [Activation plans]
~~~~~~~~~~~~~~~~~~~~~~~
The policy lives in tiering/ (tiering::plan_activations, Note [Activation
planner]); this module is the mechanism that carries a plan out on an
unchanged PyTorch model. It finds the model's repeated blocks (find_blocks,
Note [Finding blocks]: every outermost stack of two or more modules of one
class, e.g. HF GPT-2's ``h``, T5's encoder and decoder blocks; or the modules
the user gives)
and runs every forward of a block under its own saved-tensor hooks:

- keep: saved tensors stay where autograd put them (no hook at all);
- swap: every saved tensor goes to the block's tier (host or NVMe) through
  the ActivationOffloader, as TIERFLOW_OFFLOAD_ACTIVATIONS=host does;
- recompute: the block's inputs go to the tier; everything the block saves
  is dropped and rebuilt in backward by running the block again;
- split (MEMO): the inputs and the attention op's outputs go to the tier
  whole; of every saved output of a row-wise matmul (q/k/v, the MLP's first
  projection) the first ``alpha`` of its token rows go to the tier and only
  the other rows are recomputed; everything else (norms, pointwise ops,
  dropout masks) is recomputed.

How the saved tensors of an unchanged model are recognised. The first
forward of a block with a new signature (shapes, dtypes, grad mode,
autocast) runs under a TorchDispatchMode that records every aten op of the
block, which storage each op produced, and which op produced each tensor
autograd saves (in pack order, which is deterministic for the same code and
shapes — the same assumption torch.utils.checkpoint makes), into a
tiering::BlockTable. Each saved storage's class (external, input, attention,
split, cheap), which attention ops are restored and which matmuls split are
that table's decisions (Note [Block table] in tiering/block_table.hpp); this
module finds the torch facts they are made from (which storages are the
block's parameters, inputs, an op's outputs, written in place). A tensor
argument passed twice (MultiheadAttention's query is key is value) is
swapped once and is one tensor in the replay.
Later forwards reuse the table: the pack hook counts packs and checks each
tensor's shape and dtype against the table.

Backward needs the dropped tensors when it first unpacks one of the block's
placeholders (just before the block's backward). The replay then restores
the inputs, sets the CPU and device RNG states and the autocast state the
forward ran with, and runs the block again under grad mode with identity
saved-tensor hooks and a dispatch mode that walks the recorded op list: op
``j`` must be the op recorded at ``j`` (otherwise the block is not
deterministic in its ops and the replay raises, naming it); an attention op
returns its restored outputs; a split matmul computes only rows
``r0 = alpha * R`` onwards into a fresh output whose first ``r0`` rows are
the ones swapped in forward; every other op runs as it did. The placeholders
then resolve to views (the recorded sizes, strides and offset) of the
replay's storages. Everything is exact when (1) the replay runs the same ops
on the same values (RNG and autocast restored, inputs restored bit for bit)
and (2) a matmul on a suffix of the rows gives the same bits as those rows
of the full matmul. (2) is a property of the GEMM kernel and the shapes, so
it is probed on this device with the recorded shapes before a split is
planned (probe_row_split, asked by tiering::BlockTable::probe, Note [Block
table]). The probe uses the same out= form as the replay.

Profiling. With TIERFLOW_OFFLOAD_ACTIVATIONS=auto the first step records
the ops and bytes of every block under the recompute plan (the memory
floor, so the first step fits wherever any plan fits), the second step times
every block's forward and its recompute (synchronising the device around
each block, in that step only), and the plan is made before the third
forward and fixed from then on (printed once: one line per block at info,
the summary at warn). TIERFLOW_PROFILE=path reads such a profile instead
of measuring, or writes the measured one. A block's backward is timed in
the same step, from the gradient of its output to the gradient of its input,
its replay taken out (tiering::measured_block_profile, Note [Auto plan
phases]); a split's and the
attention's shares of the forward are their shares of the block's matmul
FLOPs (counted from the recorded shapes).
"""


from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .. import _C
from .._param_casts import SavedCast, around, saved_cast
from .._compile import outside_graphs
from .._hf import cache_argument
from .table import TRANSPARENT_OPS, Recorder, Saved, Table, probe_table, row_suffix_matmul, storage_key
from .side_effects import BlockState, foreign_hooks

_local = threading.local()  # .replaying: a replay runs on this thread (hooks stand aside)


def _replaying() -> bool:
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


class _Placeholder:
    """What autograd holds for a saved tensor the replay rebuilds."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: "_Frame", index: int) -> None:
        self.frame = frame
        self.index = index


class _Swapped:
    """What autograd holds for a saved tensor the offloader moved whole."""

    __slots__ = ("runtime", "handle")

    def __init__(self, runtime: Any, handle: Any) -> None:
        self.runtime = runtime
        self.handle = handle


class _Frame:
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
        self.backward_t0: Optional[float] = None  # timing step: when the gradient of its output was ready
        self.backward_wait0 = 0.0                  # timing step: the device wait just before backward_t0
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
        return _Swapped(rt, rt.pack_to(t, self.tier))

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
            return _Swapped(rt, h)
        if action == "swap_rows" and s.op not in self.prefix:
            r0 = self.table.exact_rows[s.op]
            o = self.table.ops[s.op].outputs[s.out]
            base = t.new_empty(0).set_(t.untyped_storage(), o[2], o[0], o[1])
            self.prefix[s.op] = rt.pack_to(base[:r0].clone(), self.tier)
            self.rows[s.op] = r0
        self.pending[i] = t  # until the forward ends: a departure from the table needs it (finish)
        return _Placeholder(self, i)

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
        return _Placeholder(self, i)

    # -- backward --------------------------------------------------------------------
    def unpack(self, p: _Placeholder) -> torch.Tensor:
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
        mode = _Replay(self)
        devices = [self.device.index or 0] if self.device is not None and self.device.type == "cuda" else []
        _local.replaying = True
        try:
            with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
                torch.set_rng_state(self.rng[0])
                if devices:
                    torch.cuda.set_rng_state(self.rng[1], self.device)
                dev_type, enabled, dtype, cache = self.autocast
                # Note [Replay side effects]: the state the forward started from, outside the op walk.
                with self.state.restored() if self.state is not None else _nothing(), torch.enable_grad(), \
                        torch.autocast(dev_type, dtype=dtype, enabled=enabled, cache_enabled=cache), \
                        torch.autograd.graph.saved_tensors_hooks(_alias, _identity), mode:
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
            runner.recompute_seconds.append(self.replay_seconds)


class _Replay(TorchDispatchMode):
    """Runs a block's recorded ops again (Note [Activation plans])."""

    def __init__(self, frame: _Frame) -> None:
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


# ---- the block runner: hooks on one block module -------------------------------------------------------


class BlockRunner:
    """Carries out one block's plan on every forward of it (Note [Activation plans])."""

    def __init__(self, session: Any, module: torch.nn.Module, index: int, planner: Any = None) -> None:
        self.runtime = session.runtime
        self.planner = weakref.ref(planner) if planner is not None else (lambda: None)
        self.module = module
        self.index = index
        self.mode = "recompute"   # keep | swap | split | recompute
        self.tier = "host"
        self.alpha = 0.0
        self.tables: dict = {}     # signature -> Table
        self.table: Optional[Table] = None  # the table of the last forward
        self.timing = False
        self.replays = 0           # backward replays of this block
        self.restored_ops = 0      # attention ops restored instead of run again
        self.split_rows = 0        # matmul output rows restored instead of computed
        self.forward_seconds: list = []
        self.recompute_seconds: list = []
        self.backward_seconds: list = []  # timing step: output gradient -> input gradient, replay excluded
        self.input_swap_seconds: list = []  # timing step: each forward's inputs to the tier, synchronized
        # Timing step: ("forward" | "backward", start, end, the device wait just before start) of each timed
        # interval, for the host's own time between blocks (Note [Re-plan]).
        self.intervals: list = []
        self.dynamic: Optional[str] = None  # Note [Data-dependent blocks]: why its forwards are not its table's
        # Note [Replay side effects]: the parameters and buffers its forwards write (kept before each forward
        # that may be replayed), why its last forward was not replayed, its replays that restored state.
        self.writes: set = set()
        self.not_replayed: Optional[str] = None
        self.replayable = True   # no hook of a user's on it at its last forward (the profile's `replayable`)
        self.restores = 0
        self._said: set = set()
        self._aside: Optional[tuple] = None  # Note [Hooks stand aside]: the hook order while they are off
        self._stack: list = []
        self._handles: list = []
        self.install()

    def install(self) -> None:
        """Puts the hooks on the block (once)."""
        if not self._handles:
            # Note [Hooks outside graphs]: dynamo never traces them.
            # The recorded forward ends before an FSDP2 block's post-forward hook (Note [Distributed training]):
            # its ops are FSDP2's, which its replay, under FSDP2's pre-backward state, does not run.
            fsdp = sys.modules.get("torch.distributed.fsdp")
            first = isinstance(self.module, getattr(fsdp, "FSDPModule", ())) if fsdp is not None else False
            self._hook_fns = [outside_graphs(self._before), outside_graphs(self._after)]
            self._handles = [self.module.register_forward_pre_hook(self._hook_fns[0], with_kwargs=True),
                             self.module.register_forward_hook(self._hook_fns[1], with_kwargs=True,
                                                               always_call=True, prepend=first)]

    def remove(self) -> None:
        """Takes the hooks off the block: a module with none keeps torch's fast paths (TransformerEncoderLayer's
        and MultiheadAttention's inference paths check for hooks)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._aside = None

    # Note [Hooks stand aside]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # A forward without grad (evaluation under torch.no_grad or inference_mode) saves nothing, so the runner has
    # nothing to do in it; but a hook on the block changes it anyway: nn.TransformerEncoderLayer (and
    # nn.MultiheadAttention) leave their inference fast path when any module of theirs carries a forward hook,
    # and the outputs then differ from the model's without tierflow in the last bits (6e-7 under recompute). So
    # the runner's pre-hook, called without grad, takes both of its hooks off the block before the forward runs
    # (the pre-hooks are iterated from a copy, and the fast path looks at the hooks inside forward), and the
    # session puts them back, at the places they had among the block's other hooks (FSDP2's, the parameter
    # fetches', a user's), before the model's next forward with grad (AutoPlanner.before_forward).
    def stand_aside(self) -> None:
        """Takes the runner's hooks off the block until step_in (Note [Hooks stand aside])."""
        if self._aside is not None or not self._handles:
            return
        m = self.module
        self._aside = (list(m._forward_pre_hooks), list(m._forward_hooks))
        for h in self._handles:
            m._forward_pre_hooks.pop(h.id, None)
            m._forward_hooks.pop(h.id, None)

    def step_in(self) -> None:
        """Puts the runner's hooks back where they were among the block's (Note [Hooks stand aside])."""
        if self._aside is None:
            return
        order, self._aside = self._aside, None
        if not self._handles:
            return
        m = self.module
        for d, before, handle, fn in zip((m._forward_pre_hooks, m._forward_hooks), order, self._handles,
                                         self._hook_fns):
            now = dict(d)
            d.clear()
            for k in before:  # the old order: ours come back, a hook removed since stays removed
                if k in now or k == handle.id:
                    d[k] = now.get(k, fn)
            for k, v in now.items():  # hooks added since: after
                if k not in d:
                    d[k] = v

    def refuse_replay(self, why: str) -> None:
        """Says once per reason that this block is not replayed, and why (Note [Replay side effects])."""
        self.not_replayed = why
        if why not in self._said:
            self._said.add(why)
            _C.log("warn", f"tierflow: block {self.index} ({type(self.module).__name__}) is not recomputed in "
                   f"backward: {why}; it swaps what it saves to the {self.tier} instead"
                   + ("; a hook whose only effect is on the tensors it returns can be marked with "
                      "tierflow.activations.replay_safe(hook)" if "hook" in why else ""))

    def mismatch(self, what: str) -> str:
        return (f"tierflow: block {self.index} ({type(self.module).__name__}) {what}: its forward must run the same "
                "ops for the same input shapes (the condition torch.utils.checkpoint has too); keep it on the device "
                "with TIERFLOW_OFFLOAD_ACTIVATIONS=host or none, or run it inside tierflow.no_offload()")

    def fall_back(self, why: str) -> None:
        """From now on every forward of this block swaps its saved tensors whole (Note [Data-dependent blocks])."""
        if self.dynamic is None:
            self.dynamic = why
            _C.log("warn", f"tierflow: block {self.index} ({type(self.module).__name__}) {why} for the same input "
                   "shapes: what it computes depends on its data (a mixture of experts routes other tokens to each "
                   "expert every step), so it cannot be recomputed from a recorded forward; it swaps every tensor "
                   f"it saves to the {self.tier} instead, from this forward on")

    def cache_refusal(self, cache: str) -> str:
        planner = self.planner()
        why = ("every block is recomputed during auto's two profiling steps" if planner is not None
               and planner.plan is None and not planner.forced else f"its plan is {self.mode}")
        return (f"tierflow: block {self.index} ({type(self.module).__name__}) was called with {cache} under grad (training): "
                f"it is recomputed in backward ({why}), and its replay would run on the cache its forward grew. "
                "Train without a cache: do not pass use_cache=True or past_key_values to a training forward "
                "(tierflow.wrap turns use_cache off in training when it is not passed), or use "
                "offload_activations='host' or 'none', which recompute nothing")

    def sync(self) -> None:
        if torch.cuda.is_available() and self.runtime.device == "cuda":
            torch.cuda.synchronize()

    def _backward_mark(self, f: _Frame, start: bool) -> Any:
        """A gradient hook timing one block's backward in the timing step: the gradient of its output starts
        it, the gradient of its input ends it; its replay, inside, is taken out."""
        def hook(grad: torch.Tensor) -> None:
            before = time.perf_counter()
            self.sync()
            now = time.perf_counter()
            if start:
                f.backward_t0 = now
                f.backward_wait0 = now - before  # the device work queued since the last block's end
            elif f.backward_t0 is not None:
                self.backward_seconds.append(max(now - f.backward_t0 - f.replay_seconds, 0.0))
                self.intervals.append(("backward", f.backward_t0, now, f.backward_wait0))
                f.backward_t0 = None
        return hook

    def _signature(self, args: tuple, kwargs: dict) -> tuple:
        sig = []
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                sig.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
            else:
                sig.append(type(a).__name__)
        dev = next((a.device.type for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), "cpu")
        ac = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) if dev in ("cpu", "cuda") else ()
        return (tuple(sig), ac, self.module.training)

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        planner = self.planner()
        if not torch.is_grad_enabled() and not _replaying():
            self.stand_aside()  # Note [Hooks stand aside]: _after is off too, so nothing is pushed
            return
        if _replaying() or (planner is not None and planner.keep_all):
            self._stack.append(None)
            return
        if self.mode == "keep" or _C.no_offload_depth() > 0:
            # Saved tensors stay where autograd put them, whatever the model-level hooks do (casts of offloaded
            # parameters are made again: Note [Parameter casts]).
            ctx = torch.autograd.graph.saved_tensors_hooks(*around(_alias, _identity))
            ctx.__enter__()
            self._stack.append((None, ctx, None))
            return
        external = {storage_key(p) for p in module.parameters()} | {storage_key(b) for b in module.buffers()}
        if self.dynamic is not None:  # Note [Data-dependent blocks]: no table, no replay, the model's cache is fine
            f = _Frame(self, None, False)
            f.dynamic = self.dynamic
            f.external = external
            self._enter(f, None)
            return
        # Note [Replay side effects]: a block carrying a user's hook is not replayed; it swaps instead.
        mode = self.mode
        if mode in ("recompute", "split"):
            hooks = foreign_hooks(module)
            self.replayable = not hooks
            if hooks:
                self.refuse_replay(_C.replay_refusal(hooks, []))
                mode = _C.replay_mode(_C.BlockMode.__members__[mode], False).name
        cache = cache_argument(module, args, kwargs) if mode != "swap" else None
        if cache is not None:  # a replay would run on the cache its forward grew (Note [HF caches] in _hf.py)
            self._stack.append(None)  # what _after, called even when this raises, pops
            message = self.cache_refusal(cache)
            if planner is not None and planner.plan is None:
                planner.phases.forward_refused()  # a refused forward is not one of the profiling steps
            raise _C.TierflowError(message)
        sig = self._signature(args, kwargs)
        table = self.tables.pop(sig, None)
        recording = table is None
        if table is not None:
            self.tables[sig] = table  # the most recently met, last in the order tables leave by
        if recording:
            table = Table()
        f = _Frame(self, table, recording)
        if mode != self.mode:
            f.mode = mode
        if f.mode in ("recompute", "split"):  # what a replay restores, taken before the forward
            f.state = BlockState(module, self.writes, recording)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        dev = next((t.device for t in tensors), torch.device("cpu"))
        f.device = dev
        f.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        dtype_dev = dev.type if dev.type in ("cpu", "cuda") else "cpu"
        f.autocast = (dtype_dev, torch.is_autocast_enabled(dtype_dev), torch.get_autocast_dtype(dtype_dev),
                      torch.is_autocast_cache_enabled())
        inputs = set()
        rt = self.runtime
        held: dict = {}  # id(tensor) -> its marker: an argument passed twice is one tensor in the replay too

        def hold(a: Any) -> Any:
            # Activations (tensors that require grad) go to the tier; the rest (masks, positions) stay referenced.
            if isinstance(a, torch.Tensor) and a.requires_grad and storage_key(a) not in external:
                if id(a) not in held:
                    # Identity matters: nn.MultiheadAttention(x, x, x) takes its self-attention path only
                    # when query is key is value, and would run other ops on three copies.
                    inputs.add(storage_key(a))
                    held[id(a)] = ("__tierflow_swapped__", rt.pack_to(a, self.tier))
                return held[id(a)]
            return a

        if self.timing:  # Note [Re-plan]: the inputs' swap, timed apart (the plan prices it where it applies)
            before = time.perf_counter()
            self.sync()  # device work queued since the last block: real work, stays in the rest of the step
            start = time.perf_counter()
            f.args = tree_map(hold, (args, kwargs))
            self.sync()
            f.input_swap = time.perf_counter() - start
            f.wait_before_inputs = start - before
            self.input_swap_seconds.append(f.input_swap)
        else:
            f.args = tree_map(hold, (args, kwargs))
        f.external = external
        if self.timing:  # the end of its backward: the gradient of its input (the first one that needs one)
            first = next((t for t in tensors if t.requires_grad and storage_key(t) not in external), None)
            if first is not None:
                first.register_hook(self._backward_mark(f, start=False))
        if recording:
            f.recorder = Recorder(external, inputs, table, f.state)
            f.seen = set()
            f.recorder.__enter__()
        self._enter(f, sig)

    def _enter(self, f: _Frame, sig: Optional[tuple]) -> None:
        """Starts the frame's saved-tensor hooks (and its timing); _after ends them."""
        ctx = torch.autograd.graph.saved_tensors_hooks(f.pack, _unpack)
        ctx.__enter__()
        if self.timing:
            before = time.perf_counter()
            self.sync()  # the device work queued since the last block (FSDP2's all-gather, say): real work
            f.t0 = time.perf_counter()
            # Not the host's own gap: the device's waits, and the inputs' swap (taken out of the rest apart).
            f.wait0 = f.t0 - before + f.wait_before_inputs + f.input_swap
        self._stack.append((f, ctx, sig))

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._stack:
            return
        entry = self._stack.pop()
        if entry is None:
            return
        f, ctx, sig = entry
        ctx.__exit__(None, None, None)
        if f is None:
            return
        if f.recording:  # the block's ops end here: nothing below is the block's
            f.recorder.__exit__(None, None, None)
        if f.state is not None:  # Note [Replay side effects]: what it wrote, and whether a replay can restore it
            unrestorable = f.state.compare()
            self.writes |= f.state.written() | {name for _, name in unrestorable}
            if unrestorable:
                why = _C.replay_refusal([], [f"{kind} {name}" for kind, name in unrestorable])
                f.not_replayed(why)
                self.refuse_replay(why + " (from the next forward on it is kept before the forward and restored)")
        f.finish()
        if self.timing:
            self.sync()
            now = time.perf_counter()
            self.forward_seconds.append(now - f.t0)
            self.intervals.append(("forward", f.t0, now, f.wait0))
            out = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if out is not None:
                out.register_hook(self._backward_mark(f, start=True))
        if f.table is None:  # a data-dependent block's forward: no table to keep
            return
        if f.recording:
            f.table.finish()
            self.tables[sig] = f.table
            while len(self.tables) > _C.TABLES_KEPT_PER_BLOCK:  # Note [Batch growth]: the shapes met last
                del self.tables[next(iter(self.tables))]
            f.recorder = None
            if self.mode == "split":
                if not probe_table(f.table, self.alpha):
                    _C.log("warn", f"tierflow: block {self.index}: no matmul of it splits its rows exactly on this "
                           "device; it recomputes them all")
        self.table = f.table


def _identity(t: Any) -> Any:
    return t


# Note [Saved-tensor hook aliases]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A pack hook that keeps a tensor where it is (a kept block, a replay shielded from the model-level hooks) packs
# a detached alias, never the tensor itself. A saved *output* packed as itself holds its own grad_fn, which holds
# the saved variable: a cycle through C++ that Python's collector cannot see, so the node, everything it saved and
# their storage outlive the step. That leaked each replay's attention inputs (the qkv projection), every backward
# under `recompute` and the two profiling steps' worth for good under `auto`: 9.7 GB on an H200 for the 1.34B GPT
# (measured 2026-11-26; tests/python/test_steady_memory.py). The alias shares the storage and the version
# counter and holds no graph; autograd gives a saved output its grad_fn back when it unpacks it. A replay's or a
# recording's op list does not count the detach (TRANSPARENT_OPS in table.py), and a tensor subclass detaches as
# itself (its own __torch_dispatch__ sees it).
def _alias(t: torch.Tensor) -> torch.Tensor:
    """A pack hook that keeps ``t`` where it is (Note [Saved-tensor hook aliases])."""
    return t.detach()


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Placeholder):
        return packed.frame.unpack(packed)
    if isinstance(packed, _Swapped):
        return packed.runtime.unpack(packed.handle)
    if isinstance(packed, SavedCast):
        return packed.materialize()
    return packed


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()
