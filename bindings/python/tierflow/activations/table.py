"""What one block's forward does, recorded once (Note [Activation plans] in runner.py): its aten ops, which
op produced each tensor autograd saves and its class (external, input, attention, split, cheap), and the probe
of which split matmuls give exact rows on this device."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _C

aten = torch.ops.aten

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
    func: Any
    outputs: list            # per output: (sizes, strides, offset, dtype) or None (not a tensor), or a value
    out_keys: list           # storage keys of tensor outputs (None for non-tensors)
    kind: str = "other"      # attention | matmul | other
    flops: float = 0.0
    rows: int = 0            # matmul: rows of mat1 / the output
    mat_geometry: Any = None  # matmul: shapes/strides/dtypes to probe with


@dataclass
class Saved:
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


class Recorder(TorchDispatchMode):
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
        if tensors_in and all(storage_key(a) in self.param_derived for a in tensors_in):
            self.param_derived.update(k for k in keys if k is not None)
        if func in ATTENTION_OPS:
            # An attention op with dropout draws from the device generator (flash/efficient attention advance
            # its Philox offset): restoring its outputs would skip that draw, and every later dropout mask of
            # the replay would differ. It is run again instead, from the generator state the replay restored.
            op.kind = "other" if attention_dropout(func, args, kwargs) > 0 else "attention"
            q, k_ = args[0], args[1]
            causal = bool(kwargs.get("is_causal", args[4] if func.__name__.startswith("_scaled_dot_product_flash") and len(args) > 4 else False))
            op.flops = 4.0 * q.numel() * k_.shape[-2] * (0.5 if causal else 1.0)
        elif func in ROW_MATMULS:
            i = ROW_MATMULS[func]
            m1, m2 = args[i], args[i + 1]
            op.flops = 2.0 * m1.shape[0] * m1.shape[1] * m2.shape[1]
            o = flat_out[0]
            if (m1.dim() == 2 and m1.stride(1) == 1 and m1.stride(0) == m1.shape[1] and m1.shape[0] >= 2
                    and storage_key(m2) in self.param_derived and storage_key(m1) not in self.param_derived
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


def finish_table(table: Table) -> None:
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
