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

import sys
import time
import weakref
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .. import _C, _trace
from .._param_casts import around
from .._compile import outside_graphs
from .._hf import cache_argument
from .frame import Frame, alias, identity, replaying, unpack_saved
from .table import Recorder, Table, probe_table, storage_key
from .side_effects import BlockState, foreign_hooks

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
# alias and identity, the pack and unpack hooks of such a tensor, are in frame.py (a replay uses them too).


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
        self._spans: list = []  # Note [Trace]: per forward, its span (or None), pushed in _before, popped in _after
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

    def _backward_mark(self, f: Frame, start: bool) -> Any:
        """A gradient hook timing one block's backward in the timing step: the gradient of its output starts
        it, the gradient of its input ends it; its replay, inside, is taken out.

        The hook holds the runner weakly and the frame not at all (only its BackwardClock): autograd keeps a
        tensor's hooks in C++, where Python's collector does not see them, so a strong reference here made a graph
        that outlived its step (one whose nodes the parameters' bookkeeping also held) keep the runner, the
        session and the runtime alive after unwrap() and del (a later wrap with another stall_timeout was refused
        in the same process)."""
        runner_ref, clock = weakref.ref(self), f.backward_clock

        def hook(grad: torch.Tensor) -> None:
            runner = runner_ref()
            if runner is None:
                return
            before = time.perf_counter()
            runner.sync()
            now = time.perf_counter()
            if start:
                clock.t0 = now
                clock.wait0 = now - before  # the device work queued since the last block's end
            elif clock.t0 is not None:
                runner.backward_seconds.append(max(now - clock.t0 - clock.replay, 0.0))
                runner.intervals.append(("backward", clock.t0, now, clock.wait0))
                clock.t0 = None
        return hook

    # Note [Trace]: a forward's span (and a torch.profiler range), and when tierflow's trace records, its backward's
    # from the gradient of its output to the gradient of its first input.
    def _trace_begin(self, args: tuple, kwargs: dict) -> tuple:
        marks = None
        if _C.trace_on():
            flat = tree_flatten((args, kwargs))[0]
            first = next((a for a in flat if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if first is not None:
                marks = _trace.BackwardMarks(self.index)
                first.register_hook(marks.end)
        return (_trace.begin(f"block {self.index} forward"), marks)

    def _trace_end(self, traced: tuple, output: Any) -> None:
        span, marks = traced
        _trace.end(span, _trace.Lane.forward, block=self.index)
        if marks is not None:
            out = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if out is not None:
                out.register_hook(marks.start)

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
        if not torch.is_grad_enabled() and not replaying():
            self.stand_aside()  # Note [Hooks stand aside]: _after is off too, so nothing is pushed
            return
        self._spans.append(self._trace_begin(args, kwargs) if not replaying() and _trace.on() else None)
        if replaying() or (planner is not None and planner.keep_all):
            self._stack.append(None)
            return
        if self.mode == "keep" or _C.no_offload_depth() > 0:
            # Saved tensors stay where autograd put them, whatever the model-level hooks do (casts of offloaded
            # parameters are made again: Note [Parameter casts]).
            ctx = torch.autograd.graph.saved_tensors_hooks(*around(alias, identity))
            ctx.__enter__()
            self._stack.append((None, ctx, None))
            return
        external = {storage_key(p) for p in module.parameters()} | {storage_key(b) for b in module.buffers()}
        if self.dynamic is not None:  # Note [Data-dependent blocks]: no table, no replay, the model's cache is fine
            f = Frame(self, None, False)
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
        f = Frame(self, table, recording)
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

    def _enter(self, f: Frame, sig: Optional[tuple]) -> None:
        """Starts the frame's saved-tensor hooks (and its timing); _after ends them."""
        ctx = torch.autograd.graph.saved_tensors_hooks(f.pack, unpack_saved)
        ctx.__enter__()
        if self.timing:
            before = time.perf_counter()
            self.sync()  # the device work queued since the last block (FSDP2's all-gather, say): real work
            f.t0 = time.perf_counter()
            # Not the host's own gap: the device's waits, and the inputs' swap (taken out of the rest apart).
            f.wait0 = f.t0 - before + f.wait_before_inputs + f.input_swap
        self._stack.append((f, ctx, sig))

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        traced = self._spans.pop() if self._spans else None
        try:
            self._after_block(module, args, kwargs, output)
        finally:  # after the recording ends: a torch.profiler range's exit is an op, not the block's
            if traced is not None:
                self._trace_end(traced, output)

    def _after_block(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
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
