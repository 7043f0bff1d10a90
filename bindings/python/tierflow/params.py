"""Parameters on the host or NVMe between uses (TIERFLOW_OFFLOAD_PARAMS=host|nvme): the module hooks that tell
tiering::ParamSchedule when each unit is used, on an unchanged model.

Note [Parameter hooks]
~~~~~~~~~~~~~~~~~~~~~~
The schedule (Note [Parameter residency] in tiering/param_schedule.hpp) decides
what moves; _C.ParamResidency carries it out on the parameters' storages (Note
[Parameter storage]); _C.ParamUses counts the uses and holds and sends the
schedule's events in order (Note [Parameter uses], tiering/param_uses.hpp);
this module only watches modules, tensors and autograd nodes. Units: the
repeated blocks (find_blocks, or the blocks given to wrap), each with every
parameter inside it, then one unit per other module that holds parameters of
its own (the embeddings, the final norm, the head, the model itself): each is
fetched for its own use, so embeddings that outweigh a block are not on the
device through the step, and a weight two modules hold (a tied embedding and
head) is one parameter that each one's use fetches.

Uses are per call. A unit's pre-hook (run before any other: the activation
plans' hooks may record its ops) begins a forward use and its forward hook
(run after the others) ends it; uses nest (a module inside the model's
forward). For the backward, the forward hook finds the call's tensors that
need a gradient (its output's, one level into objects that are no pytree,
and its modules' tensor attributes: an auxiliary loss kept on a module) and
puts a hook on each the call made: the first gradient of one begins the
call's backward use. It walks back from them through the autograd nodes
the call made (sequence numbers from the call's start) to the call's last
nodes, those with an edge out of it (to one of its inputs, to a leaf such
as a weight, to a node made before it), and puts a post-hook on each; the
use ends once every last node the engine will run in this backward
(torch._C._will_engine_execute_node) has run: a node runs after every node
of the call above it, so nothing of the call reads its weights after that,
a branch of weights only (latents, a merged LoRA weight) included (a last
node that is an output's node is counted as one that runs: Note [Who holds
a call]). The
graph is not changed (an identity function on the inputs, as FSDP2's
post-backward, regroups the sums of a shared input's gradient). So an input
every block shares (T5's position bias, an encoder's output under
cross-attention) holds no block, two forwards before one backward are two
uses each, and a parameter two open uses list stays until the last one ends
(the schedule counts open uses). A call that made no last node the backward
runs keeps its use until the end of backward: a callback queued on the
engine when it starts ends what is still open, and the phase, which
releases what is left (prefetches for a use that did not come). The model's
forward hook ends the forward phase the same way. A recompute (a gradient
checkpoint, a replay of Note [Activation plans]) runs a block's forward
inside its open backward use: its pre-hook does nothing, unless no use is
open. Then, when a call of the unit still waits for its backward (a
non-reentrant checkpoint around several blocks recomputes them all; the
engine never runs the recompute's graph), the recompute's use ends with its
forward; else (a reentrant checkpoint's first forward ran under no_grad: no
call) the recompute's own nested backward ends it, through its last nodes.

Reads outside uses. Every module holding parameters reads them through its
_parameters, which becomes a _WatchedParameters during wrap: in a forward or
backward, a read of an offloaded parameter that no open use lists (OLMo's
head, F.linear(h, self.wte.weight), in the model's forward; a block reading a
weight another module holds) is served as Note [Parameter uses], Reads
outside uses, says (joins the block reading it, or held until the end of the
next backward). A read is seen, not what it reads: a read of a weight's dtype
fetches it too. A read tierflow cannot see (a reference kept,
model.parameters() after training) finds the parameter released and raises
the error of Note [Parameter storage], naming it and tierflow.gathered.

Auto. With TIERFLOW_OFFLOAD_PARAMS=auto every unit is fetched from the host
during the two steps the activation planner measures; its plan (Note
[Activation planner], Parameters: which blocks keep their parameters, within
TIERFLOW_GPU_MEMORY, together with the activations; rest_params for every
other unit) is applied when the forward it was made in ends: those units'
parameters are copied to the device once and stay
(ParamSchedule::make_resident), and the optimizer steps them there from then
on.
Everything else. With a torch optimizer (offload_optimizer="none") step()
runs with every parameter pointing at its host copy (NVMe: read into a host
tensor, written back after the step), which it updates in place; on the
emulated device only, whose device tensors are CPU tensors (on CUDA the
gradients are on the device: use the CPU optimizer, which steps the host
copies and never reads the device). tierflow's CPUAdamW steps the host copies
(NVMe: it writes each new value there in step(); those parameters step after
backward, not during it). state_dict() and load_state_dict(): Note [Parameter
state].
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from . import _C
from ._compile import outside_graphs
from ._distributed import _ddp_around, _ddp_inside
from .activations.blocks import find_blocks
from ._param_casts import forget as forget_casts, forward_use_begins, forward_use_ended, read as cast_read, \
    resident as casts_resident
from ._param_state import state_hooks


_DDP_REFUSAL = ("TIERFLOW_OFFLOAD_PARAMS (host or nvme) under torch.nn.parallel.DistributedDataParallel (DDP): not "
                "supported yet (DDP broadcasts and reads the parameters themselves, which live off the device "
                "between uses); accepted under DDP: TIERFLOW_OFFLOAD_PARAMS=none")


def _in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (a recompute's forward)."""
    return torch._C._current_graph_task_id() != -1


def _tensors_of(out: Any, module: torch.nn.Module) -> list:
    """The tensors a call leaves that need a gradient: its output's (pytree leaves, and one level into other
    objects, such as dataclasses), and those its modules keep as attributes, or in a list or dict attribute (an
    auxiliary loss kept on the module, added to the loss later). Their gradients begin the call's backward use; the walk from them finds
    its last nodes."""
    found, seen = [], set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            found.append(t)

    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            add(leaf)
        elif hasattr(leaf, "__dict__"):
            for v in vars(leaf).values():
                add(v)
    for m in module.modules():
        for name, v in vars(m).items():
            if isinstance(v, torch.Tensor):
                add(v)
            elif isinstance(v, (list, tuple, dict)) and name not in ("_parameters", "_buffers", "_modules") and \
                    not name.endswith("hooks"):
                for t in tree_flatten(v)[0]:  # an auxiliary loss kept in a list or dict
                    add(t)
    return found


def _node_hook(me: Any, call: int) -> Any:
    """A post-hook of one of a call's last nodes: it knows the call by its record's id (the call holds its last
    nodes below its outputs, whose hooks hold the call: the graph owns it without a cycle, Note [Who holds a
    call])."""
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        offload = me()
        if offload is not None:
            offload.uses.edge_ran(call)
    return hook


def _grad_hook(me: Any, method: str, *args: Any) -> Any:
    """A tensor hook that calls ``method`` of the ParamOffload ``me`` refers to (it must not keep it alive)."""
    def hook(grad: torch.Tensor) -> None:
        offload = me()
        if offload is not None:
            getattr(offload, method)(*args)
    return hook


# Note [Who holds a call]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A call's record lives as long as its graph: the gradient hooks on the outputs it made hold its _Call (and
# nothing else does, once its forward returned), and the _Call holds the last nodes it counts. Autograd keeps a
# node's hooks in C++, where Python's collector sees them only while nothing but one Python object holds the
# node, so a _Call holding a node from which one of those outputs' nodes is reachable (that node itself: a
# residual block's ``x + f(x)``, an embedding, whose node has its edge out of the call) is a cycle the collector
# frees one call per collection at best, each call's last nodes holding the previous call's output: every step's
# graph piled up (46 nodes and 12 calls after 3 steps, 86 and 23 after 8: the loop fuzzer's mlp_bn under auto;
# tests/python/test_param_graph_lifetime.py). So a call holds only the last nodes below its hooked outputs, and
# counts the others (``unheld``) as ones the backward runs: one that does not run (an output no gradient reaches
# whose node has an edge out of the call) keeps its use open until the end of backward, as a call with no last
# node that runs does. The recompute's check for an unbegun call (_unit_begins) looks at the nodes it holds (it
# holds none: not transient, and the recompute's use stays open until the end of backward). And the call lets go
# of its inputs' nodes once it has walked from its outputs: they lead to the previous call's output, whose hooks
# hold that call.


def _above(ends: list, below: dict, hooked: Any) -> set:
    """Of ``ends`` (and the call's nodes under them: ``below`` gives each node's nodes of the call it has an
    edge to), those from which a node in ``hooked`` is reachable, itself included."""
    above: dict = {}  # node -> whether a hooked node is reachable from it
    for end in ends:
        stack = [(end, False)]
        while stack:
            node, done = stack.pop()
            if node in above:
                continue
            if done:
                above[node] = node in hooked or any(above[n] for n in below.get(node, ()))
                continue
            stack.append((node, True))
            stack.extend((n, False) for n in below.get(node, ()) if n not in above)
    return {n for n in ends if above[n]}


class _Call:
    """The torch side of one call of a unit, whose record (its use's counts) is _C.ParamUses's, by ``id``: the
    autograd nodes of its inputs and its last nodes (Note [Parameter hooks]). Its record goes with it."""

    __slots__ = ("id", "unit", "casts", "start", "inputs", "ends", "unheld", "me", "__weakref__")

    def __init__(self, me: Any, unit: int, casts: int, start: int, inputs: list) -> None:
        self.me = me
        self.id = me().uses.new_call(unit, casts)
        self.unit = unit
        self.casts = casts  # bytes of autocast's casts of its weights its forward made (its backward makes again)
        self.start = start  # the sequence number of the first autograd node the call may make
        self.inputs: Optional[list] = inputs  # the autograd nodes of its inputs that need a gradient, until
        # _watch_call has walked from its outputs (then None: Note [Who holds a call])
        self.ends: Optional[list] = None  # its last nodes it may hold (_watch_call), once its forward returned
        self.unheld = 0  # its last nodes it may not hold (Note [Who holds a call]): each counted as one that runs

    def expected_ends(self) -> int:
        """Its last nodes this backward runs, as far as it can tell: those it holds that the engine will run,
        and every one it does not hold (one that does not run keeps its use open to the end of backward)."""
        return sum(1 for n in self.ends or () if torch._C._will_engine_execute_node(n)) + self.unheld

    def __del__(self) -> None:
        uses = getattr(self.me(), "uses", None)
        if uses is not None:
            uses.drop_call(self.id)


_ACCUMULATE = (1 << 64) - 1  # an AccumulateGrad node's sequence number
_counter = torch.zeros((), requires_grad=True)  # a CPU leaf whose view tells the next sequence number


def _next_sequence_nr() -> int:
    return _counter.view_as(_counter).grad_fn._sequence_nr() + 1


class _WatchedParameters(dict):
    """A module's _parameters that tells its ParamOffload of each read in a forward or backward (Note [Parameter
    hooks], Reads outside uses)."""

    __slots__ = ("reads",)

    def __getitem__(self, key: str) -> Any:
        p = dict.__getitem__(self, key)
        reads = self.reads
        if reads.active and p is not None:
            offload = reads.offload()
            if offload is not None:
                offload._read(p)
        return p


class _Reads:
    """Whether reads are watched now (during a forward or backward), shared by every _WatchedParameters."""

    __slots__ = ("active", "offload")

    def __init__(self, offload: Any) -> None:
        self.active = False
        self.offload = offload


class ParamOffload:
    """The parameter hooks of one wrapped model (Note [Parameter hooks])."""

    def __init__(self, session: Any, model: torch.nn.Module, blocks: Optional[list]) -> None:
        if _ddp_inside(model) is not None:
            raise _C.ConfigError(_DDP_REFUSAL)
        blocks = list(blocks) if blocks is not None else find_blocks(model)
        if not blocks:
            raise _C.ConfigError(
                f"offload_params: found no repeated blocks in {type(model).__name__} (Note [Finding blocks]); "
                "pass blocks=[...] to tierflow.wrap, or use offload_params='none'")
        names = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        module_names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        units: list = [[p for p in block.parameters()] for block in blocks]
        unit_names = [f"block {i} ({module_names.get(id(b), '?') or type(b).__name__})" for i, b in enumerate(blocks)]
        inside = {id(m) for block in blocks for m in block.modules()}
        in_blocks = {id(p) for u in units for p in u}
        rest_modules = [m for m in model.modules()
                        if id(m) not in inside and any(True for _ in m.parameters(recurse=False))]
        for m in rest_modules:
            units.append(list(m.parameters(recurse=False)))
            unit_names.append(f"'{module_names.get(id(m)) or type(m).__name__}'")
        self.rest = len(blocks)  # the first unit that is not a block
        # Holds every unit's parameter as long as this offload (and its _C.ParamUses) lives: they are known below by
        # their TensorImpl's address (tiering::ParamId), which must not be reused by another tensor meanwhile.
        self._params = [p for u in units for p in u]
        self._ids = {id(p) for p in self._params}
        self.rest_bytes = sum(p.numel() * p.element_size()
                              for p in {id(p): p for u in units[self.rest:] for p in u if id(p) not in in_blocks}.values())
        # Per unit, its fp32 elements that require grad: what autocast casts (counted with the use).
        self._fp32_params = [[p for p in u if p.dtype == torch.float32 and p.requires_grad] for u in units]
        self._fp32 = [sum(p.numel() for p in u) for u in self._fp32_params]
        self._device_type = self._params[0].device.type if self._params else "cpu"
        self._runtime = session.runtime
        setting = session.settings.offload_params
        self.planned = setting == "auto"  # every unit fetched from the host until the plan says which stay
        self.tier = "host" if self.planned else setting
        param_names = [names.get(id(p), "?") for u in units for p in u]
        self.impl = _C.ParamResidency(session.runtime, units, [self.tier] * len(units), param_names, len(blocks),
                                      unit_names)
        # The uses, their counts and holds, and the order of the schedule's events (Note [Parameter uses]).
        self.uses = _C.ParamUses(self.impl, units, len(blocks), param_names, self.tier)
        self._model = weakref.ref(model)
        self._forward: dict = {}  # an open forward use's token -> (casts refilled, autocast cache to restore, _Call)
        self._recomputing: dict = {}  # call id -> _Call begun by a recompute in backward, until its forward hook
        self._calls: "weakref.WeakValueDictionary[int, _Call]" = weakref.WeakValueDictionary()
        self._resident: Optional[list] = None  # auto: the units the plan keeps on the device, until applied
        self._optimizer: Optional[Any] = None  # weak reference to the CPUAdamW stepping these parameters
        self._handles: list = []
        me = weakref.ref(self)
        self._me = me
        self._reads = _Reads(me)

        def call(method: str, *args: Any) -> Any:
            offload = me()
            return getattr(offload, method)(*args) if offload is not None else None

        hook = outside_graphs  # Note [Hooks outside graphs]
        self._handles.append(model.register_forward_pre_hook(
            hook(lambda m, a: call("_model_begins")), prepend=True))
        self._handles.append(model.register_forward_hook(
            hook(lambda m, a, out: call("_model_ends", out)), always_call=True))
        self._model_of_unit = list(blocks) + rest_modules
        for u, module in enumerate(list(blocks) + rest_modules):
            # The model's own unit (parameters it holds itself) opens after _model_begins and closes before
            # _model_ends: registered after the first, with prepend before the second.
            self._handles.append(module.register_forward_pre_hook(
                hook(lambda m, a, kw, u=u: call("_unit_begins", u, a, kw)), prepend=module is not model,
                with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                hook(lambda m, a, out, u=u: call("_unit_ends", u, out)), always_call=True, prepend=module is model))
        self._watched = []
        for module in model.modules():
            params = module.__dict__.get("_parameters")
            if params and not isinstance(params, _WatchedParameters):
                watched = _WatchedParameters(params)
                watched.reads = self._reads
                module._parameters = watched
                self._watched.append(module)
        self._handles += state_hooks(model, me)  # Note [Parameter state]

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of these parameters."""
        return any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"])

    def remove(self) -> None:
        """Removes the hooks and gives every parameter its device memory and value back (unwrap)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._watched:
            if isinstance(module.__dict__.get("_parameters"), _WatchedParameters):
                module._parameters = dict(module._parameters)
        self._watched = []
        self._reads.active = False
        forget_casts()
        self._end_forward_uses()
        self._close_backward()
        self.uses.release_held()
        self.impl.point_at_host(False)
        self.uses.end_phase()
        # Every unit resident: the parameters get their memory and values back, and the optimizer that
        # stepped their host copies steps them on the device again.
        self._make_resident(list(range(self.uses.units())))
        _live.discard(self)

    def adopt_optimizer(self, cpu_optimizer: Any) -> None:
        """tierflow's CPUAdamW steps the host copies; any other optimizer over these parameters steps them
        pointed at their host copies where the device allows it (_torch_optimizer_step), else is refused then."""
        if cpu_optimizer is not None:
            cpu_optimizer.use_host_copies(self)
            self._optimizer = weakref.ref(cpu_optimizer)
        _install_step_hooks()
        _live.add(self)

    # -- forward ----------------------------------------------------------------------------------
    def _model_begins(self) -> None:
        model = self._model()
        if model is not None and _ddp_around(model) is not None:  # DDP(model) after wrap
            raise _C.ConfigError(_DDP_REFUSAL)
        if not _in_backward():
            self._close_backward()  # a backward that never reached its end (an error): its phase ends here
            self._end_forward_uses()  # a forward that raised
            self.uses.model_begins()  # holds of a forward no backward followed end
            self._reads.active = True

    def _model_ends(self, out: Any) -> None:
        if _in_backward():
            return
        self._end_forward_uses()
        self.uses.end_phase()
        if self._resident is not None:  # between phases: the plan's resident units
            self._make_resident(self._resident)
            self._resident = None
        graph = torch.is_grad_enabled()
        if graph:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(_grad_hook(self._me, "_backward_begins"))
        else:
            self._reads.active = False
        self.uses.model_ends(graph)

    def _unit_begins(self, u: int, args: Any, kwargs: Any) -> Any:
        if _in_backward():
            # A recompute: its call's backward use is open, unless its first forward ran under no_grad (a
            # reentrant checkpoint): then the recompute begins one, and its identity ends it.
            if not self.uses.recompute_opens(u) or not torch.is_grad_enabled():
                return
            call = self._new_call(u, self._cast_bytes(u), args, kwargs)
            self._call_begins(call)
            # A call of the unit whose backward has not begun: a non-reentrant checkpoint recomputes a region that
            # holds it, and the engine never runs the recompute's graph (that call's own use comes later); the
            # use ends with the recompute's forward. Else a reentrant one, whose nested backward ends it.
            unbegun = [self._calls.get(c) for c in self.uses.unbegun(u)]
            transient = any(c is not None and any(torch._C._will_engine_execute_node(n) for n in c.ends or ())
                            for c in unbegun)  # (of this backward's graph: not a forward discarded)
            self._recomputing[call.id] = call
            self.uses.recompute_begins(call.id, transient)
            return
        casts = self._cast_bytes(u)
        grad = torch.is_grad_enabled()
        call = self._new_call(u, casts, args, kwargs) if grad else None
        token = self.uses.begin_forward(u, casts, call.id if call is not None else 0)  # over the budget: raises
        cache = None
        if casts and not grad:
            # Note [Parameter casts]: a use without a graph casts without autocast's cache (the same values; no
            # gradient reads them), which leaves the cache, and every cast in it, as it is.
            cache = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(False)
        self._forward[token] = (None, cache, call)  # (None: forward_use_begins raised)
        # Note [Parameter casts]: autocast's casts of its weights this region has made get their memory back.
        refilled = forward_use_begins(self._fp32_params[u], self._device_type) if casts and grad else []
        self._forward[token] = (refilled, cache, call)

    def _new_call(self, u: int, casts: int, args: Any, kwargs: Any) -> _Call:
        inputs = [get_gradient_edge(t).node for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        call = _Call(self._me, u, casts, _next_sequence_nr(), inputs)
        self._calls[call.id] = call
        return call

    def _cast_bytes(self, u: int) -> int:
        """The most autocast's casts of unit u's fp32 weights can hold (Note [Parameter casts]), counted with
        its use in the budget: autocast's 16-bit dtype's bytes for each fp32 element that requires grad."""
        elements = self._fp32[u]
        if elements == 0 or not torch.is_autocast_enabled(self._device_type):
            return 0
        return elements * torch.get_autocast_dtype(self._device_type).itemsize

    def _unit_ends(self, u: int, out: Any) -> None:
        if _in_backward():
            ended = self.uses.recompute_ends(u)
            if ended is not None:
                call = self._recomputing.pop(ended[0])
                if ended[1]:  # transient
                    self.uses.end_call(call.id)
                    return
                self._watch_call(call, out)  # the recompute's own backward (all of it) ends its use
                self.uses.expect_ends(call.id, len(call.ends) + call.unheld)
            return
        use = self.uses.pop_forward(u)
        if use is None:
            return  # its begin raised (over the budget)
        _, casts, token, _ = use
        refilled, cache, call = self._forward.pop(token)
        if cache is not None:
            torch.set_autocast_cache_enabled(cache)
        graph = call is not None and torch.is_grad_enabled()
        out = _tensors_of(out, self._model_of_unit[u])
        # Its outputs it made (not passed through): their first gradient begins its backward use.
        made = [t for t in out if t.grad_fn is not None and call.start <= t.grad_fn._sequence_nr() != _ACCUMULATE] \
            if graph else []
        cast = self._watch_call(call, out, {t.grad_fn for t in made}) if graph else None
        self._forward_use_ended(u, casts, refilled, cast)
        if graph:
            self.uses.watched(call.id)
            for t in made:
                t.register_hook(_grad_hook(self._me, "_call_begins", call))

    def _watch_call(self, call: _Call, out: Any, hooked: Any = ()) -> list:
        """Finds the call's last nodes (walking back from its outputs through the nodes it made: those with an
        edge out of the call, to one of its inputs, a leaf such as a weight, or a tensor made before it) and
        hooks each: a node runs after every node of the call above it, so once those of them the backward runs
        have run, nothing of the call needs its weights (a branch of weights only, such as latents or a merged
        LoRA weight, included). ``hooked``: the nodes of its outputs whose gradient hooks hold the call (Note [Who
        holds a call]). Returns the unit's fp32 weights the call cast (autocast's ToCopyBackward0 into their
        AccumulateGrad: Note [Parameter casts])."""
        inputs = set(call.inputs or ())
        call.inputs = None  # walked: Note [Who holds a call]
        weights = {id(p) for p in self._fp32_params[call.unit]} if call.casts else ()
        cast = []
        stack = [t.grad_fn for t in out if t.grad_fn is not None]
        seen: set = set()
        below: dict = {}  # a node of the call -> the nodes of the call it has an edge to
        ends = []
        while stack:
            node = stack.pop()
            if node in seen or node in inputs:
                continue
            seen.add(node)
            seq = node._sequence_nr()
            if seq < call.start or seq == _ACCUMULATE:
                continue  # made before the call (a tensor it read from elsewhere), or a leaf
            leaves = False
            inside = below[node] = []
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if nxt in inputs or nxt._sequence_nr() < call.start or nxt._sequence_nr() == _ACCUMULATE:
                    leaves = True
                else:
                    stack.append(nxt)
                    inside.append(nxt)
            if leaves:
                ends.append(node)
            if weights and node.name() == "ToCopyBackward0":
                p = getattr(node.next_functions[0][0], "variable", None)
                if p is not None and id(p) in weights:
                    cast.append(p)
        # Note [Who holds a call]: the call holds no last node above one that holds the call.
        above = _above(ends, below, hooked) if hooked else set()
        call.ends = [n for n in ends if n not in above]
        call.unheld = len(ends) - len(call.ends)
        for node in ends:
            node.register_hook(_node_hook(self._me, call.id))
        return cast

    def _forward_use_ended(self, u: int, casts: int, refilled: list, cast: Optional[list]) -> None:
        """``refilled``: the casts that came back when the use began; ``cast``: the unit's weights autocast cast
        in the use (None: a use that built no graph)."""
        try:
            if casts and refilled is not None:  # autocast's casts of the unit's weights go with its use
                forward_use_ended(refilled, cast, self._device_type)  # (Note [Parameter casts])
        finally:
            self.uses.end_forward(u, casts)

    def _end_forward_uses(self) -> None:
        while (use := self.uses.pop_forward()) is not None:
            u, casts, token, _ = use
            refilled, cache, _ = self._forward.pop(token)
            if cache is not None:
                torch.set_autocast_cache_enabled(cache)
            self._forward_use_ended(u, casts, refilled, None)

    # -- reads outside uses -------------------------------------------------------------------------
    def _read(self, p: torch.Tensor) -> None:
        if self.uses.read(p):  # attached to the block reading it, or held (Note [Parameter uses])
            cast_read(p, self._device_type)  # its cast in autocast's cache, if its memory went (Note [Parameter casts])

    # -- backward -----------------------------------------------------------------------------------
    def _backward_begins(self) -> None:
        if self.uses.begin_backward(torch.is_grad_enabled()):  # (refuses one inside a forward, or double backward)
            self._reads.active = True
            me = self._me
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: me() is not None and me()._close_backward())

    def _call_begins(self, call: _Call) -> None:
        if not self.uses.in_backward():
            self._backward_begins()  # backward from a unit's output, not the model's
        if self.uses.begin_call(call.id) and call.ends is not None:  # (a recompute's call counts them when its
            # forward returns) The last nodes this backward runs (not those of an output no gradient reaches).
            self.uses.expect_ends(call.id, call.expected_ends())

    def _close_backward(self) -> None:
        """The end of backward: every use still open ends, then the holds, and the phase with them."""
        if self.uses.in_backward():
            self._reads.active = False
            self.uses.close_backward()

    # -- auto: the plan's residences ----------------------------------------------------------------
    def plan_residences(self, plan: dict) -> None:
        """TIERFLOW_OFFLOAD_PARAMS=auto: the units whose parameters the plan keeps on the device, made
        resident when the forward the plan was made in ends (between phases)."""
        units = [i for i, b in enumerate(plan["blocks"]) if b.get("params") == "gpu"]
        if plan.get("rest_params") == "gpu":
            units += range(self.rest, self.uses.units())
        self._resident = units

    def _make_resident(self, units: list) -> None:
        params = self.impl.make_resident(units) if units else []
        gone = {id(p) for p in params}
        self._ids -= gone
        self.uses.forget(params)
        # Resident weights' casts are autocast's alone again (Note [Parameter casts]).
        self._fp32_params = [[p for p in u if id(p) not in gone] for u in self._fp32_params]
        self._fp32 = [sum(p.numel() for p in u) for u in self._fp32_params]
        casts_resident(params, self._device_type)
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is not None and params:
            opt.params_became_resident(params)
        _C.log("info", f"tierflow parameters: {len(units)} of {self.uses.units()} units resident from now on "
                       f"({sum(p.numel() * p.element_size() for p in params)} bytes)")

    # -- outside forward and backward --------------------------------------------------------------
    def host_copy(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The host copy of ``p`` on the host tier (the optimizer steps it in place), else None."""
        return self.impl.host_copy(p)

    def offloaded(self, p: torch.Tensor) -> bool:
        return self.impl.offloaded(p)

    def load(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s value between uses, on the host (its host copy, or read from NVMe)."""
        return self.impl.load(p)

    def store(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` (a contiguous CPU tensor of p's dtype and shape) becomes p's value between uses."""
        self.impl.store(p, value)

    def point_at_host(self, on_host: bool) -> None:
        self.impl.point_at_host(on_host)

    def stats(self) -> dict:
        return self.impl.stats()

# -- torch optimizers over offloaded parameters ----------------------------------------------------
# Note [Parameter hooks], "Everything else": any torch optimizer (made before or after wrap) steps the host
# copies, through torch's global step hooks; tierflow's CPUAdamW steps them itself.
_live: "weakref.WeakSet[ParamOffload]" = weakref.WeakSet()
_hooks_installed = False


def _offloads_of(optimizer: torch.optim.Optimizer) -> list:
    from .optim import CPUAdamW

    if isinstance(optimizer, CPUAdamW):
        return []
    return [o for o in list(_live) if o.holds(optimizer)]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for offload in _offloads_of(optimizer):
        why = offload._runtime.params_optimizer_refusal(False)
        if why is not None:
            raise _C.ConfigError(f"{why} ({type(optimizer).__name__} steps them)")
        offload.point_at_host(True)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for offload in _offloads_of(optimizer):
        offload.point_at_host(False)


def _install_step_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True
