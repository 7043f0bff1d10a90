"""What one block's forward does, recorded once (Note [Activation plans] in runner.py): the recorder of its
aten ops and the tensors autograd saves, and the probe of which split matmuls give exact rows on this device.
The decisions over the recording (each saved tensor's class, which attention ops are restored and which
matmuls split, the exact rows, the bytes and FLOPs per class) are tiering::BlockTable's (Note [Block table]);
this module keeps the torch side of each record beside it, indexed the same."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _C

aten = torch.ops.aten

# Ops that neither the table nor a replay counts: they compute nothing and return an alias of their input, and
# whether one runs can depend on autograd's state rather than on the model. transformers 5's Mixtral
# (grouped_mm experts) dispatches an aten.detach in a layer's replay that its forward did not, at the inverse
# permutation of its tokens; counted, the replay was refused as a departure from its forward.
TRANSPARENT_OPS = frozenset({aten.detach.default})

# Attention ops whose outputs (attention output and softmax statistics) are
# swapped whole and restored in a split block's replay.
ATTENTION_OPS = {
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(aten, name)
}
# Row-wise matmuls: a suffix of mat1's rows gives a suffix of the output's rows.
ROW_MATMULS = {aten.mm.default: 0, aten.addmm.default: 1}  # op -> index of mat1 in args


def attention_dropout(func: Any, args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` an attention op was called with (0 where its schema has none)."""
    for k, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            v = kwargs["dropout_p"] if "dropout_p" in kwargs else args[k] if k < len(args) else a.default_value
            return float(v or 0.0)
    return 0.0


def storage_key(t: torch.Tensor) -> tuple:
    """A storage's identity while it is alive."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())




@dataclass
class Op:
    """The torch side of a recorded op (its kind, FLOPs and rows are in Table.core)."""

    func: Any
    outputs: list            # per output: (sizes, strides, offset, dtype) or None (not a tensor), or a value
    out_keys: list           # storage keys of tensor outputs (None for non-tensors)
    mat_geometry: Any = None  # matmul: shapes/strides/dtypes to probe with


@dataclass
class Saved:
    """The torch side of a saved tensor: its producer (indices into Table.ops) and its view of the storage
    (its class and bytes are in Table.core)."""

    op: int = -1             # producing op (-1: none)
    out: int = 0             # its output index
    sizes: tuple = ()
    strides: tuple = ()
    offset: int = 0
    dtype: Any = None


class Table:
    """What one block's forward does (Note [Activation plans]): tiering::BlockTable (Note [Block table]) and,
    indexed the same, the torch side of its ops and saved tensors. The decisions read after finish() and
    probe() are copied here once, not made here."""

    def __init__(self) -> None:
        self.core = _C.BlockTable()
        self.ops: list = []       # Op, indexed as core's ops
        self.saved: list = []     # Saved, indexed as core's saved tensors
        self.classes: list = []   # each saved tensor's class, after finish()
        self.restorable: set = set()   # attention ops whose outputs are all saved
        self.split_ops: set = set()    # matmuls with a saved, row-splittable output
        self.mutated_ops: set = set()  # matmuls whose saved output was written in place: never split
        self.exact_rows: dict = {}     # op -> r0 probed exact (see probe_row_split)
        self._actions: dict = {}       # mode -> core.actions(mode), until the probe changes

    def add_op(self, op: Op, kind: str, flops: float, rows: int) -> None:
        elements = [-1 if o[0] == "value" else math.prod(o[0]) for o in op.outputs]
        self.core.add_op(kind, float(flops), int(rows), elements)
        self.ops.append(op)

    def add_saved(self, s: Saved, cls: str, nbytes: int, first: bool, mutated: bool = False) -> None:
        """A saved tensor: ``cls`` external or input, or produced by ``s.op`` (its class then follows the op)."""
        if s.op >= 0:
            self.core.add_produced(s.op, s.out, nbytes, first, mutated)
        else:
            self.core.add_saved(cls, nbytes, first)
        self.saved.append(s)

    def finish(self) -> None:
        """Which attention ops can be restored and which matmuls split (tiering::BlockTable::finish)."""
        self.core.finish()
        self.classes = self.core.classes()
        self.restorable = set(self.core.restorable())
        self.split_ops = set(self.core.split_ops())
        self.mutated_ops = set(self.core.mutated_ops())

    def actions(self, mode: str) -> list:
        """tiering::saved_action of every saved tensor for ``mode`` (cached until the probe changes)."""
        if mode not in self._actions:
            self._actions[mode] = self.core.actions(mode)
        return self._actions[mode]


class Recorder(TorchDispatchMode):
    """Records the ops of one block forward (Note [Activation plans])."""

    def __init__(self, external: set, inputs: set, table: Table, state: Any = None) -> None:
        super().__init__()
        self.table = table
        # Note [Replay side effects]: the block's parameters and buffers, kept before their first write.
        self.state = state
        self.guard: dict = state.guard() if state is not None else {}
        self.producer: dict = {}               # storage key -> (op, out)
        self.param_derived = set(external)    # storage keys derived from parameters and buffers only
        self.inputs = inputs
        self.mutated: set = set()              # storage keys an in-place or out= op wrote since their producer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.guard and func._schema.is_mutable:
            self._before_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in TRANSPARENT_OPS:
            return out
        j = len(self.table.ops)
        flat_out = out if isinstance(out, (tuple, list)) else (out,)
        tensors_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        in_keys = {storage_key(a) for a in tensors_in}
        outputs, keys = [], []
        for o in flat_out:
            if isinstance(o, torch.Tensor):
                outputs.append((tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype))
                k = storage_key(o)
                keys.append(k)
                if k not in in_keys:  # a fresh storage; views and in-place ops keep their producer
                    self.producer[k] = (j, len(keys) - 1)
                    self.mutated.discard(k)
                elif func._schema.is_mutable:  # written in place (add_, mul_, dropout's bernoulli_, out=)
                    self.mutated.add(k)
            else:
                outputs.append(("value", o))
                keys.append(None)
        op = Op(func, outputs, keys)
        kind, flops, rows = "other", 0.0, 0
        if tensors_in and all(storage_key(a) in self.param_derived for a in tensors_in):
            self.param_derived.update(k for k in keys if k is not None)
        # The kind, FLOPs and rows are tiering's rules (Note [Block table]); torch only reads the numbers.
        if func in ATTENTION_OPS:
            q, k_ = args[0], args[1]
            causal = bool(kwargs.get("is_causal", args[4] if func.__name__.startswith("_scaled_dot_product_flash") and len(args) > 4 else False))
            kind, flops = _C.attention_op(attention_dropout(func, args, kwargs), q.numel(), k_.shape[-2], causal)
        elif func in ROW_MATMULS:
            i = ROW_MATMULS[func]
            m1, m2 = args[i], args[i + 1]
            o = flat_out[0]
            kind, flops, rows = _C.row_matmul(
                list(m1.shape), list(m1.stride()), storage_key(m1) in self.param_derived, list(m2.shape),
                storage_key(m2) in self.param_derived, o.is_contiguous() and o.storage_offset() == 0)
            if kind == "matmul":
                op.mat_geometry = {
                    "args": [(tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a
                             for a in args],
                    "kwargs": dict(kwargs), "device": o.device,
                }
        elif func in (aten.bmm.default, aten.matmul.default):
            a, b = args[0], args[1]
            flops = _C.batched_matmul_flops(a.numel(), b.shape[-1])
        self.table.add_op(op, kind, flops, rows)
        return out

    def _before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op that writes in place: the block's parameters and buffers it writes are copied first."""
        for k, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            value = kwargs[a.name] if a.name in kwargs else args[k] if k < len(args) and not a.kwarg_only else None
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    names = self.guard.get(storage_key(t))
                    if names:
                        self.state.before_write(names)


def row_suffix_matmul(func: Any, args: tuple, kwargs: dict, r0: int, prefix: Optional[torch.Tensor]) -> torch.Tensor:
    """``func(*args)`` computing only rows r0.. of mat1; rows ..r0 come from ``prefix``.

    The same code runs in probe_row_split, so a probed-exact shape is exact here."""
    i = ROW_MATMULS[func]
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


def probe_row_split(op: Op, r0: int, seed: int = 0) -> bool:
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
    part = row_suffix_matmul(op.func, tuple(args), geo["kwargs"], r0, full[:r0])
    return bool(torch.equal(full, part))


def probe_table(table: "Table", alpha: float) -> bool:
    """Sets the exact first rows of each split matmul of ``table`` for ``alpha`` (tiering::BlockTable::probe,
    which asks probe_row_split for a proper suffix); False when none is exact."""
    exact = table.core.probe(alpha, _C.SPLIT_ROW_GRANULE, lambda j, r0: probe_row_split(table.ops[j], r0))
    table.exact_rows = dict(table.core.exact_rows())
    table._actions.clear()
    return exact
