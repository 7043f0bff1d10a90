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
shapes — the same assumption torch.utils.checkpoint makes). A saved storage
is then one of: external (parameters, buffers, tensors made before the
block: kept by reference), input (a tensor argument of the block: swapped
whole), attention (an output of an SDPA/flash/efficient attention op whose
every non-empty output autograd saves: swapped whole, and in the replay the
op is not run, its outputs are restored — attention is most of the compute
at long context and is never recomputed; an attention op with dropout is
cheap instead: it draws from the device generator, and the replay must draw
as forward did), split (the output of ``mm`` /
``addmm`` whose first operand is an activation with contiguous rows and
whose second is derived from parameters only, and which no in-place or out=
op wrote between the matmul and the save: the replay would apply that op to
swapped rows that already hold its result, so such a matmul is rerun whole),
or cheap (anything else). A tensor argument passed twice (MultiheadAttention's
query is key is value) is swapped once and is one tensor in the replay.
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
planned (probe_row_split): where it fails, the op is recomputed whole and
the block's split bytes count as cheap (Note [Activation planner]: such a
block is not splittable). The probe uses the same out= form as the replay.

Profiling. With TIERFLOW_OFFLOAD_ACTIVATIONS=auto the first step records
the ops and bytes of every block under the recompute plan (the memory
floor, so the first step fits wherever any plan fits), the second step times
every block's forward and its recompute (synchronising the device around
each block, in that step only), and the plan is made before the third
forward and fixed from then on (printed once: one line per block at info,
the summary at warn). TIERFLOW_PROFILE=path reads such a profile instead
of measuring, or writes the measured one. The time of a block's backward is
taken as twice its forward (the matmul FLOP ratio); a split's and the
attention's shares of the forward are their shares of the block's matmul
FLOPs (counted from the recorded shapes).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from . import _C
from ._compile import outside_graphs
from ._hf import cache_argument

aten = torch.ops.aten

# Attention ops whose outputs (attention output and softmax statistics) are
# swapped whole and restored in a split block's replay.
_ATTENTION_OPS = {
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(aten, name)
}
# Row-wise matmuls: a suffix of mat1's rows gives a suffix of the output's rows.
_ROW_MATMULS = {aten.mm.default: 0, aten.addmm.default: 1}  # op -> index of mat1 in args

_local = threading.local()  # .replaying: a replay runs on this thread (hooks stand aside)


def attention_dropout(func: Any, args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` an attention op was called with (0 where its schema has none)."""
    for k, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            v = kwargs["dropout_p"] if "dropout_p" in kwargs else args[k] if k < len(args) else a.default_value
            return float(v or 0.0)
    return 0.0


def _replaying() -> bool:
    return getattr(_local, "replaying", False)


def _skey(t: torch.Tensor) -> tuple:
    """A storage's identity while it is alive."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model``, in registration order (Note [Finding blocks])."""
    def holds_params(m: torch.nn.Module) -> bool:
        return any(True for _ in m.parameters())

    def stacks(leaves: bool) -> list:
        # Each stack: two or more children of one module, of one class, each holding parameters.
        found = []
        for parent in model.modules():
            children = list(parent.children())
            if isinstance(parent, _CONTAINERS):
                if len(children) >= 2 and len({type(c) for c in children}) == 1 and all(map(holds_params, children)):
                    found.append(children)
            elif not leaves:
                by_class: dict = {}
                for c in children:
                    if not isinstance(c, _CONTAINERS) and any(True for _ in c.children()) and holds_params(c):
                        by_class.setdefault(type(c), []).append(c)
                found += [group for group in by_class.values() if len(group) >= 2]
        return found

    groups = stacks(leaves=True) or stacks(leaves=False)
    # The outermost stacks: one inside a member of another (a block's experts) is part of that block.
    inside = set()
    for group in groups:
        for member in group:
            inside.update(id(m) for m in member.modules() if m is not member)
    chosen = {id(m) for group in groups if not any(id(m) in inside for m in group) for m in group}
    return [m for m in model.modules() if id(m) in chosen]


_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)

# Note [Finding blocks]
# ~~~~~~~~~~~~~~~~~~~~~
# A block is one repetition of a model's stack of layers: what the activation
# plans act on. The stacks people write come as containers (nn.ModuleList:
# HF's decoders; nn.Sequential; nn.ModuleDict: torchtitan's layers) whose
# children are two or more modules of one class holding parameters, or, with no
# such container, as attributes of one module (self.block0, self.block1, ...):
# two or more children of one class that hold parameters and have submodules of
# their own (two nn.Linear or nn.Embedding side by side are layers, not a
# stack). Every such stack is taken, not only the largest: an encoder-decoder
# (T5, nn.Transformer) has two, and all four of a ResNet's stages are stacks.
# A stack inside a member of another stack is part of that member (Mixtral's
# experts are part of its decoder layer), so only the outermost stacks give
# blocks, listed in the order the model registers them (its forward order in
# every model of the zoo, tests/python/test_model_zoo.py). Blocks differ in
# class and size across stacks; each gets its own profile and plan. With no
# stack, there are no blocks: auto keeps every saved tensor where it fits and
# swaps them all where it does not (Note [Activation plans], AutoPlanner).


# ---- the recorded table ---------------------------------------------------------------


@dataclass
class _Op:
    func: Any
    outputs: list            # per output: (sizes, strides, offset, dtype) or None (not a tensor), or a value
    out_keys: list           # storage keys of tensor outputs (None for non-tensors)
    kind: str = "other"      # attention | matmul | other
    flops: float = 0.0
    rows: int = 0            # matmul: rows of mat1 / the output
    mat_geometry: Any = None  # matmul: shapes/strides/dtypes to probe with


@dataclass
class _Saved:
    cls: str                 # external | input | attention | split | cheap
    op: int = -1             # producing op (attention, split, cheap)
    out: int = 0             # its output index
    sizes: tuple = ()
    strides: tuple = ()
    offset: int = 0
    dtype: Any = None
    nbytes: int = 0          # the storage's bytes
    first: bool = True       # first save of this storage in the block


@dataclass
class Table:
    """What one block's forward does (Note [Activation plans])."""

    ops: list = field(default_factory=list)
    saved: list = field(default_factory=list)
    restorable: set = field(default_factory=set)   # attention ops whose outputs are all saved
    split_ops: set = field(default_factory=set)    # matmuls with a saved, row-splittable output
    exact_rows: dict = field(default_factory=dict)  # op -> r0 probed exact (see probe_row_split)
    mutated_ops: set = field(default_factory=set)  # matmuls whose saved output was written in place: never split

    def actions(self, mode: str) -> list:
        """tiering::saved_action of every saved tensor for ``mode`` (cached until the probe changes)."""
        key = (mode, tuple(sorted(self.exact_rows.items())))
        if getattr(self, "_actions_key", None) != key:
            exact = [(s.cls == "attention" and s.op in self.restorable)
                     or (s.cls == "split" and self.exact_rows.get(s.op, 0) > 0) for s in self.saved]
            self._actions = _C.saved_actions(mode, [s.cls for s in self.saved], exact)
            self._actions_key = key
        return self._actions

    def bytes_by_class(self) -> dict:
        out = {"input": 0, "attention": 0, "split": 0, "cheap": 0}
        for s in self.saved:
            if s.first and s.cls in out:
                out[s.cls] += s.nbytes
        return out

    def flops_by_class(self) -> dict:
        att = sum(self.ops[j].flops for j in self.restorable)
        split = sum(self.ops[j].flops for j in self.split_ops)
        total = sum(o.flops for o in self.ops)
        return {"attention": att, "split": split, "total": total}


class _Recorder(TorchDispatchMode):
    """Records the ops of one block forward (Note [Activation plans])."""

    def __init__(self, external: set, inputs: set, table: Table) -> None:
        super().__init__()
        self.table = table
        self.producer: dict = {}               # storage key -> (op, out)
        self.param_derived = set(external)    # storage keys derived from parameters and buffers only
        self.inputs = inputs
        self.mutated: set = set()              # storage keys an in-place or out= op wrote since their producer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        j = len(self.table.ops)
        flat_out = out if isinstance(out, (tuple, list)) else (out,)
        tensors_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        in_keys = {_skey(a) for a in tensors_in}
        outputs, keys = [], []
        for o in flat_out:
            if isinstance(o, torch.Tensor):
                outputs.append((tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype))
                k = _skey(o)
                keys.append(k)
                if k not in in_keys:  # a fresh storage; views and in-place ops keep their producer
                    self.producer[k] = (j, len(keys) - 1)
                    self.mutated.discard(k)
                elif func._schema.is_mutable:  # written in place (add_, mul_, dropout's bernoulli_, out=)
                    self.mutated.add(k)
            else:
                outputs.append(("value", o))
                keys.append(None)
        op = _Op(func, outputs, keys)
        if tensors_in and all(_skey(a) in self.param_derived for a in tensors_in):
            self.param_derived.update(k for k in keys if k is not None)
        if func in _ATTENTION_OPS:
            # An attention op with dropout draws from the device generator (flash/efficient attention advance
            # its Philox offset): restoring its outputs would skip that draw, and every later dropout mask of
            # the replay would differ. It is run again instead, from the generator state the replay restored.
            op.kind = "other" if attention_dropout(func, args, kwargs) > 0 else "attention"
            q, k_ = args[0], args[1]
            causal = bool(kwargs.get("is_causal", args[4] if func.__name__.startswith("_scaled_dot_product_flash") and len(args) > 4 else False))
            op.flops = 4.0 * q.numel() * k_.shape[-2] * (0.5 if causal else 1.0)
        elif func in _ROW_MATMULS:
            i = _ROW_MATMULS[func]
            m1, m2 = args[i], args[i + 1]
            op.flops = 2.0 * m1.shape[0] * m1.shape[1] * m2.shape[1]
            o = flat_out[0]
            if (m1.dim() == 2 and m1.stride(1) == 1 and m1.stride(0) == m1.shape[1] and m1.shape[0] >= 2
                    and _skey(m2) in self.param_derived and _skey(m1) not in self.param_derived
                    and o.is_contiguous() and o.storage_offset() == 0):
                op.kind = "matmul"
                op.rows = m1.shape[0]
                op.mat_geometry = {
                    "args": [(tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a
                             for a in args],
                    "kwargs": dict(kwargs), "device": o.device,
                }
        elif func in (aten.bmm.default, aten.matmul.default):
            a, b = args[0], args[1]
            op.flops = 2.0 * a.numel() * b.shape[-1]
        self.table.ops.append(op)
        return out


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
        if _skey(t) in self.external:
            return t
        rt = self.runner.runtime
        return _Swapped(rt, rt.pack_to(t, self.tier))

    def depart(self, why: str, t: Optional[torch.Tensor] = None) -> Any:
        """This forward is not its table's (Note [Data-dependent blocks]): the rest is swapped whole, and what
        was left to the replay is swapped whole when the forward ends (finish)."""
        self.dynamic = why
        self.runner.fall_back(why)
        return self._pack_whole(t) if t is not None else None

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

    def _pack_planned(self, i: int, s: _Saved, t: torch.Tensor) -> Any:
        rt = self.runner.runtime
        if self._actions is None:
            self._actions = self.table.actions(self.mode)
        action = self._actions[i]
        if action == "reference":
            return t
        if action == "swap":
            h = rt.pack_to(t, self.tier)
            if s.cls == "attention":
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
        rec: _Recorder = self.recorder
        k = _skey(t)
        s = _Saved("external", sizes=tuple(t.shape), strides=tuple(t.stride()), offset=t.storage_offset(),
                   dtype=t.dtype, nbytes=t.untyped_storage().nbytes())
        if k in rec.inputs:
            s.cls = "input"
        elif k in rec.producer and k not in self.external:
            s.op, s.out = rec.producer[k]
            op = rec.table.ops[s.op]
            s.cls = {"attention": "attention", "matmul": "split"}.get(op.kind, "cheap")
            if s.cls == "split" and k in rec.mutated:
                # Its rows were written in place after the matmul: the replay would apply that op to swapped
                # rows that already hold its result. The matmul is rerun whole instead (see _finish_table).
                s.cls = "cheap"
                rec.table.mutated_ops.add(s.op)
        # Addresses are reused once a dropped tensor is freed: a storage is its address and producer.
        s.first = (k, s.op) not in self.seen
        self.seen.add((k, s.op))
        rec.table.saved.append(s)
        # No table yet: the recording forward runs the swap or the recompute plan, which need none.
        if s.cls == "external":
            return t
        if self.mode == "swap" or s.cls == "input":
            return _Swapped(self.runner.runtime, self.runner.runtime.pack_to(t, self.tier))
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
                with torch.enable_grad(), torch.autocast(dev_type, dtype=dtype, enabled=enabled,
                                                         cache_enabled=cache), \
                        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), mode:
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
        if runner.timing:
            runner.sync()
            runner.recompute_seconds.append(time.perf_counter() - t0)


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
            out = _row_suffix_matmul(func, args, kwargs, f.rows[j], rt.unpack(f.prefix[j]))
            f.runner.split_rows += f.rows[j]
        else:
            out = func(*args, **kwargs)
        if j in self.needed_ops:
            flat = out if isinstance(out, (tuple, list)) else (out,)
            for k, o in enumerate(flat):
                if isinstance(o, torch.Tensor):
                    self.outputs[(j, k)] = o
        return out


def _row_suffix_matmul(func: Any, args: tuple, kwargs: dict, r0: int, prefix: Optional[torch.Tensor]) -> torch.Tensor:
    """``func(*args)`` computing only rows r0.. of mat1; rows ..r0 come from ``prefix``.

    The same code runs in probe_row_split, so a probed-exact shape is exact here."""
    i = _ROW_MATMULS[func]
    m1, m2 = args[i], args[i + 1]
    out = torch.empty((m1.shape[0], m2.shape[1]), dtype=m1.dtype if func is aten.mm.default or args[0].dim() == 0
                      else torch.result_type(m1, m2), device=m1.device)
    if prefix is not None:
        out[:r0].copy_(prefix)
    if func is aten.mm.default:
        aten.mm.out(m1[r0:], m2, out=out[r0:])
    else:
        aten.addmm.out(args[0], m1[r0:], m2, beta=kwargs.get("beta", 1), alpha=kwargs.get("alpha", 1), out=out[r0:])
    return out


def probe_row_split(op: _Op, r0: int, seed: int = 0) -> bool:
    """Whether the replay's suffix matmul gives the bits of the full op for this shape (random data)."""
    geo = op.mat_geometry
    g = torch.Generator().manual_seed(seed)
    args = []
    for a in geo["args"]:
        if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], torch.dtype):
            sizes, strides, dtype = a
            span = 1 + sum((s - 1) * st for s, st in zip(sizes, strides)) if all(sizes) else 0
            base = torch.randn(max(span, 1), generator=g).to(dtype=dtype, device=geo["device"])
            args.append(base.as_strided(sizes, strides))
        else:
            args.append(a)
    full = op.func(*args, **geo["kwargs"])
    part = _row_suffix_matmul(op.func, tuple(args), geo["kwargs"], r0, full[:r0])
    return bool(torch.equal(full, part))


_ROW_GRANULE = 8  # a split's first rows are a multiple of this (whole cache lines of a row-major output)


def probe_table(table: "Table", alpha: float) -> bool:
    """Sets the exact first rows of each split matmul of ``table`` for ``alpha``; False when none is exact."""
    table.exact_rows.clear()
    for j in sorted(table.split_ops):
        op = table.ops[j]
        r0 = _C.split_rows(alpha, op.rows, _ROW_GRANULE)
        if r0 == op.rows or (0 < r0 < op.rows and probe_row_split(op, r0)):
            table.exact_rows[j] = r0
    return bool(table.exact_rows)


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
        self.dynamic: Optional[str] = None  # Note [Data-dependent blocks]: why its forwards are not its table's
        self._stack: list = []
        self._handles: list = []
        self.install()

    def install(self) -> None:
        """Puts the hooks on the block (once)."""
        if not self._handles:
            # Note [Hooks outside graphs]: dynamo never traces them.
            self._handles = [self.module.register_forward_pre_hook(outside_graphs(self._before), with_kwargs=True),
                             self.module.register_forward_hook(outside_graphs(self._after), with_kwargs=True,
                                                               always_call=True)]

    def remove(self) -> None:
        """Takes the hooks off the block: a module with none keeps torch's fast paths (TransformerEncoderLayer's
        and MultiheadAttention's inference paths check for hooks)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

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
        if _replaying() or not torch.is_grad_enabled() or (planner is not None and planner.keep_all):
            self._stack.append(None)
            return
        if self.mode == "keep" or _C.no_offload_depth() > 0:
            # Saved tensors stay where autograd put them, whatever the model-level hooks do.
            ctx = torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
            ctx.__enter__()
            self._stack.append((None, ctx, None))
            return
        external = {_skey(p) for p in module.parameters()} | {_skey(b) for b in module.buffers()}
        if self.dynamic is not None:  # Note [Data-dependent blocks]: no table, no replay, the model's cache is fine
            f = _Frame(self, None, False)
            f.dynamic = self.dynamic
            f.external = external
            self._enter(f, None)
            return
        cache = cache_argument(module, args, kwargs) if self.mode != "swap" else None
        if cache is not None:  # a replay would run on the cache its forward grew (Note [HF caches] in _hf.py)
            self._stack.append(None)  # what _after, called even when this raises, pops
            message = self.cache_refusal(cache)
            if planner is not None and planner.plan is None and planner.forwards > 0:
                planner.forwards -= 1  # a refused forward is not one of the profiling steps
            raise _C.TierflowError(message)
        sig = self._signature(args, kwargs)
        table = self.tables.get(sig)
        recording = table is None
        if recording:
            table = Table()
        f = _Frame(self, table, recording)
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
            if isinstance(a, torch.Tensor) and a.requires_grad and _skey(a) not in external:
                if id(a) not in held:
                    # Identity matters: nn.MultiheadAttention(x, x, x) takes its self-attention path only
                    # when query is key is value, and would run other ops on three copies.
                    inputs.add(_skey(a))
                    held[id(a)] = ("__tierflow_swapped__", rt.pack_to(a, self.tier))
                return held[id(a)]
            return a

        f.args = tree_map(hold, (args, kwargs))
        f.external = external
        if recording:
            f.recorder = _Recorder(external, inputs, table)
            f.seen = set()
            f.recorder.__enter__()
        self._enter(f, sig)

    def _enter(self, f: _Frame, sig: Optional[tuple]) -> None:
        """Starts the frame's saved-tensor hooks (and its timing); _after ends them."""
        ctx = torch.autograd.graph.saved_tensors_hooks(f.pack, _unpack)
        ctx.__enter__()
        if self.timing:
            self.sync()
            f.t0 = time.perf_counter()
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
        f.finish()
        if self.timing:
            self.sync()
            self.forward_seconds.append(time.perf_counter() - f.t0)
        if f.table is None:  # a data-dependent block's forward: no table to keep
            return
        if f.recording:
            f.recorder.__exit__(None, None, None)
            _finish_table(f.table)
            self.tables[sig] = f.table
            f.recorder = None
            if self.mode == "split":
                if not probe_table(f.table, self.alpha):
                    _C.log("warn", f"tierflow: block {self.index}: no matmul of it splits its rows exactly on this "
                           "device; it recomputes them all")
        self.table = f.table


def _identity(t: Any) -> Any:
    return t


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Placeholder):
        return packed.frame.unpack(packed)
    if isinstance(packed, _Swapped):
        return packed.runtime.unpack(packed.handle)
    return packed


def _finish_table(table: Table) -> None:
    """Which attention ops can be restored and which matmuls split (Note [Activation plans])."""
    saved_outputs = {(s.op, s.out) for s in table.saved if s.op >= 0}
    for j, op in enumerate(table.ops):
        if op.kind == "attention":
            nonempty = [(j, k) for k, m in enumerate(op.outputs) if m[0] != "value" and math.prod(m[0]) > 0]
            if nonempty and all(x in saved_outputs for x in nonempty):
                table.restorable.add(j)
        elif op.kind == "matmul" and j not in table.mutated_ops and any(s.op == j and s.cls == "split"
                                                                         for s in table.saved):
            table.split_ops.add(j)
    for s in table.saved:
        if s.cls == "attention" and s.op not in table.restorable:
            s.cls = "cheap"
        if s.cls == "split" and s.op not in table.split_ops:
            s.cls = "cheap"
