"""tierflow under torch.distributed: what works, what is refused (Note [Distributed training]).

Note [Distributed training]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every combination of tierflow with torch.distributed either trains right or
is refused with an error that names it:

- DistributedDataParallel (DDP) trains right, with every activation and
  optimizer setting, in both orders: tierflow.wrap(DDP(model), ...) and
  DDP(model) of a wrapped model, and the CPU optimizer steps each parameter
  during backward (Note [Step during backward] in step_ledger.hpp) from its
  reduced gradient, never from the local one that DDP's all-reduce replaces.
  DDP is seen in wrap (the model is or holds a DDP module) or at a forward of
  the wrapped model (DDP's forward calls it with
  DistributedDataParallel._active_ddp_module set to itself), before the first
  backward; tierflow then registers a DDP communication hook
  (_ddp_feed.py; DDP checks nothing but that one is registered once, before
  the backward that uses it: Reducer::register_comm_hook in torch's
  reducer.cpp). Per bucket the hook reduces as DDP does without one: each
  gradient times 1 / world size (mark_variable_ready_dense's mul_out), or
  divided by it with gradient_as_bucket_view=True (as DDP does from its
  second backward on; in the first it multiplies, which rounds differently
  only for a world size that is not a power of two), then an all-reduce
  sum; and the callback of the all-reduce's future hands the reduced bucket
  to the gradient stream (GradStream::on_reduced in grad_stream_reduced.cpp: each
  carried parameter's slice copied to pinned host memory on the copy engine,
  then stepped on the optimizer worker while backward goes on). The local
  gradient hook only counts those parameters. What torch does, in order
  (torch/csrc/distributed/c10d/reducer.cpp): AccumulateGrad's post hook
  (Reducer::autograd_hook) marks a gradient ready and copies it into its
  bucket (mark_variable_ready_dense); a full bucket runs the comm hook
  (all_reduce_bucket -> run_comm_hook); the last gradient queues
  finalize_backward as an autograd final callback; finalize_backward waits for
  each bucket's future (so our callback has run) and only then writes the
  result into p.grad (finalize_bucket_dense: copy_bucket_to_grad's
  grad.copy_(bucket_view) with gradient_as_bucket_view=False, which changes
  p.grad's version; with True p.grad already is the bucket's view). So the
  stream's end of backward, queued at the first gradient, queues itself once
  more from within the final callbacks, which runs it after
  finalize_backward, and there records p.grad's identity as the one the
  streamed gradient has (Note [Step ledger], "Reduced gradients"): step()
  commits the early step when p.grad was not changed after that, as without
  DDP. Under no_sync() DDP neither reduces nor calls the hook: the local
  gradients accumulate and nothing streams until the reducing backward, whose
  reduced gradient streams (the n-th rule of TIERFLOW_GRAD_ACCUMULATION_STEPS
  counts local backwards, so the default 1 fits no_sync); another backward
  before step() takes the step back. TIERFLOW_MAX_GRAD_NORM clips the reduced
  gradients: the early steps are redone only when the clip binds.
  static_graph=True (whose first backward reduces every bucket in a final
  callback of DDP's, queued before ours: torch/nn/parallel/distributed.py's
  _DDPSink) and find_unused_parameters=True (a parameter no rank used streams
  DDP's zeros; DDP leaves its p.grad None, so that step is taken back) work
  the same way (tested). Under DDP's join() (uneven inputs) a rank that ran
  out of inputs runs the hook on zeros outside any backward, to match the
  others' all-reduces (DistributedDataParallel._match_all_reduce_for_bwd_pass):
  it reduces and streams nothing; join(divide_by_initial_world_size=False),
  whose divisor DDP tells its own reduction only, is refused from the hook.
  A communication hook the user registers on the DDP module after tierflow saw
  it runs in place of tierflow's all-reduce (ddp.register_comm_hook is
  replaced on that instance), and what its future holds streams: that is what
  DDP writes into p.grad (a result of another dtype than a parameter's steps
  in step()). A built-in hook registered after that is refused (DDP takes one
  hook). One registered before tierflow saw the DDP module (the user's, DDP's
  mixed_precision's, optimizer-in-backward's) cannot be composed with: the
  steps during backward are turned off for the rest of the run with a warning
  that says why and what to do, and every parameter steps in step() from the
  reduced gradient, as with TIERFLOW_OVERLAP_STEP=off, so the results are the
  same; the same holds for DDP's Python reducer (compiled autograd). A
  gradient all-reduce that tierflow cannot see (written by hand between
  backward() and step()) shows at step(): in a process group of more than one
  process, a step in which the early steps had to be redone and none could
  be committed turns them off the same way, with its own warning (one wasted
  step). With several ranks the CPU optimizer is partitioned across them
  (TIERFLOW_PARTITION_OPTIMIZER=on, the default; Note [Partitioned
  optimizer] in optimizer/partition.hpp): when DDP is seen, before the first
  backward, each rank keeps the states of, streams and steps only the
  parameters it owns, and step() broadcasts every parameter's new weights
  from its owner, so the node holds one copy of the states; each rank saves
  and loads its own optimizer state dict.
- TIERFLOW_OFFLOAD_GRADIENTS=on under DDP is refused: it sets p.grad to None
  during backward, while DDP's reducer still has to read and all-reduce it
  (with DDP applied after wrap the losses silently left DDP's).
- FSDP2 (torch.distributed.fsdp.fully_shard) trains right with every
  activation setting, in either order (wrap of a sharded model, or
  fully_shard after wrap, found at the wrapped model's first forward), with
  the user's optimizer stepping FSDP2's shards (TIERFLOW_OFFLOAD_OPTIMIZER=
  none: bit-identical to FSDP2 alone) or tierflow's CPU AdamW (host, the
  default, or nvme, which steps in step() with each rank's states in its own
  swap files; fully_shard before wrap) stepping each rank's shard: ZeRO-Offload's
  design on FSDP2, one copy of the optimizer states on the node, within the
  CPU AdamW's rounding of FSDP2 with torch's AdamW. Three things make it so.
  FSDP2's unsharded parameters are not registered parameters
  (model.parameters() holds the DTensor shards), and FSDP2 frees their
  storage after each unit's forward and gathers it again for backward: a
  saved tensor that is one of them, or a view of one (the weight.t() a
  linear layer saves), copied to the host as an activation was read after
  its storage was freed. So before each FSDP2 unit's forward, after FSDP2's
  own pre-forward hook has gathered its parameters, the session tells the
  offloader their storages, and those saved tensors stay where FSDP2
  manages them. A block's recorded forward ends before FSDP2's post-forward
  hook (the runner's forward hook is put first on an FSDP2 module): its
  replay runs the module with FSDP2's hooks, which do nothing during
  backward (FSDP2's pre-backward state, as for torch.utils.checkpoint), so
  the hook's ops must not be in the record. And the CPU AdamW steps the
  local shard of each DTensor parameter from the local shard of its
  reduce-scattered gradient (copies.local_shard), during backward: FSDP2
  sets each unit's sharded gradients in the unit's post-backward, which no
  gradient hook sees, so tierflow._fsdp_feed puts an identity autograd
  function on the unit's inputs ahead of FSDP2's own, whose backward (right
  after FSDP2's post-backward) hands the new local gradients to the stream
  as DDP's reduced buckets are (GradStream::add_fed_parameter, on_reduced);
  what FSDP2 reduces in its final callback (the root unit) is fed from a
  final callback queued after FSDP2's. step() confirms each early step as
  under DDP (bit for bit the shards stepped in step() alone, tested, with
  clips, a GradScaler, several FSDP2 roots with accumulation). The
  gradient's identity, taken at the feed (FSDP2 assigned it before: unlike
  DDP's, nothing is written back later), is the DTensor's with the version
  counters of both it and its local tensor; a foreach op on DTensors (torch's
  clip, a GradScaler's unscale) moves neither, so the clip wrapper moves it
  for the clip (Note [Clip picked up]), and before the clip and in step()
  each fed gradient's fingerprint (the sum of its bit patterns) is compared with the
  one it streamed with: a change no counter showed is stepped again from
  p.grad. On CUDA the feed reads on a stream of its own that waits for
  FSDP2's post-reduce event (unmeasured). Under wrap only (which finds the
  units); a CPUAdamW made directly steps them in step(). Its
  state_dict gives each state of a DTensor parameter as a DTensor like the
  parameter (as torch's AdamW's are under FSDP2), so torch.distributed.
  checkpoint saves every rank's shard and loads each back where it belongs
  (tested: a run resumed from DCP is bit-identical to the one that went on,
  fp32 and bf16); load_state_dict takes DTensor states, and, as every
  parameter steps in step(), takes a saved fp32 master as it is and keeps it
  at the next step where its parameter is its rounding (set_state_dict loads
  the model after the optimizer). The states stay in host memory in those
  DTensors (built around the local tensor, as FSDP2's CPUOffloadPolicy
  does: DTensor.from_local would copy them to the mesh's GPU). A CPU
  optimizer over a model only partly under fully_shard is refused (its plain
  parameters' gradients are not reduced), also when a CPUAdamW is made
  directly, which applies the same refusals as wrap. What FSDP2 and
  DTensor models are refused with, in either order (FSDP2's settings, FSDP2
  after a wrap that made the CPU optimizer, tensor parallelism, another
  model's DTensors), and what TIERFLOW_OFFLOAD_ACTIVATIONS=auto budgets under
  FSDP2 (this rank's shards and FSDP2's gathered copies, read when it plans)
  are decided torch-free: Note [Sharded models] in tiering/
  distributed_sharding.hpp, tiering::fsdp_settings_refusal and
  tiering::fsdp_gathered_bytes (Note [Auto plan phases]).

What is decided here is decided torch-free, below bindings/: the partition, DDP's bucket scaling, the DDP
refusals and warnings in optimizer/distributed_ranks.hpp (Note [Rank decisions under DDP]), the FSDP2 and DTensor
refusals, each unit's own parameters and this rank's parameter bytes in tiering/distributed_sharding.hpp (Note
[Sharded models]), through _C.distributed; this file finds torch's facts and applies the answers.

Nothing here imports torch.distributed's submodules: a class that was never
imported has no instances, so a run without torch.distributed pays one
sys.modules lookup per check.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

import torch

from . import _C, _ddp_feed


def _class(module: str, name: str) -> Optional[type]:
    """``module.name`` if that module has been imported (nothing can be an instance otherwise)."""
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def rank_and_world_size() -> tuple:
    """(this process's rank, processes in the default process group): (0, 1) without one. The runtime divides
    the machine's RAM and NVMe among the ranks on it (Note [Ranks on one machine] in tiering/tiers.hpp)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _world_size() -> int:
    """Processes in the default process group (1 without one)."""
    return rank_and_world_size()[1]


# -- FSDP2 and DTensor parameters: refused ----------------------------------------


def _sharded(model: torch.nn.Module) -> tuple:
    """(names of the FSDP2 modules in ``model``, "" for the model itself; names of its DTensor parameters)."""
    fsdp = _class("torch.distributed.fsdp", "FSDPModule")
    dtensor = _class("torch.distributed.tensor", "DTensor")
    modules = [] if fsdp is None else [n for n, m in model.named_modules() if isinstance(m, fsdp)]
    params = [] if dtensor is None else \
        [n for n, p in model.named_parameters(remove_duplicate=False) if isinstance(p, dtensor)]
    return modules, params


def fsdp_modules(model: torch.nn.Module) -> list:
    """The FSDP2 modules (fully_shard) in ``model``, the model itself included."""
    fsdp = _class("torch.distributed.fsdp", "FSDPModule")
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


def fsdp_cpu_offloaded(model: torch.nn.Module) -> bool:
    """Whether a unit of ``model`` was sharded with FSDP2's CPUOffloadPolicy (fully_shard's offload_policy)."""
    policy = _class("torch.distributed.fsdp", "CPUOffloadPolicy")
    for unit in fsdp_modules(model):
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)  # None: a unit with no parameters
        if policy is not None and isinstance(getattr(group, "offload_policy", None), policy):
            return True
    return False


def fsdp_units(model: torch.nn.Module) -> list:
    """[(an FSDP2 module of ``model``, its own parameters)] in module order (Note [Sharded models]: the parameters
    outside the fully_shard modules within it)."""
    units = fsdp_modules(model)
    number: dict = {}  # id(parameter) -> (its number, in order of first appearance; the parameter)
    listed = [[number.setdefault(id(p), (len(number), p))[0] for p in unit.parameters()] for unit in units]
    params = [p for _n, p in number.values()]
    return [(u, [params[i] for i in own]) for u, own in zip(units, _C.distributed.fsdp_unit_parameters(listed))]


def fsdp_unit_bytes(model: torch.nn.Module) -> tuple:
    """(each FSDP2 unit's unsharded parameter bytes, in module order, the root's left out; the root unit's): what
    tiering::fsdp_gathered_bytes weighs (Note [Auto plan phases]). A unit is a fully_shard module's parameters
    outside the fully_shard modules within it; the root is the model's own, when fully_shard was applied to it.
    Bytes at the shards' dtype (a MixedPrecisionPolicy that gathers in a narrower one is counted high). ([], 0)
    without FSDP2."""
    units = fsdp_units(model)
    sizes = [(u, sum(p.numel() * p.element_size() for p in params)) for u, params in units]
    return [size for u, size in sizes if u is not model], sum(size for u, size in sizes if u is model)


def rank_shard_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of ``model``'s parameters (Note [Sharded models]): a DTensor's local shard; a parameter of
    an FSDP2 unit that FSDP2 holds gathered at the moment (the root unit's from its forward through its backward:
    the planner decides inside a forward) as FSDP2's dim-0 chunk of it; any other parameter whole."""
    dtensor = _class("torch.distributed.tensor", "DTensor")
    params = list(model.parameters())
    sharded = {id(p): p for p in params if dtensor is not None and isinstance(p, dtensor)}
    rank, world, gathered = 0, 1, set()
    if sharded:
        mesh = next(iter(sharded.values())).device_mesh
        rank, world = mesh.get_local_rank(), mesh.size()
        gathered = {id(p) for unit in fsdp_modules(model) for p in unit.parameters()}
    facts = [(id(p) in sharded, id(p) in gathered, p.shape[0] if p.dim() > 0 else -1,
              (p.to_local() if id(p) in sharded else p).numel(), p.element_size()) for p in params]
    return _C.distributed.rank_shard_bytes(facts, rank, world)


def refuse_sharded(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], config: Any) -> None:
    """tierflow.wrap, before anything is made: an FSDP2 model with settings that cannot train it, DTensor
    parameters that FSDP2 did not make (tensor parallelism), and an optimizer holding DTensors of another
    model are refused, with a TierflowError that says what to do instead."""
    modules, params = _sharded(model)
    dtensor = _class("torch.distributed.tensor", "DTensor")
    held = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    theirs = [p for p in held if dtensor is not None and isinstance(p, dtensor)]
    replacing = optimizer is not None and config.offload_optimizer != "none"
    why = _C.distributed.sharded_wrap_refusal(config, modules, params, replacing,
                                              bool(modules) and fsdp_cpu_offloaded(model), len(theirs), len(held),
                                              list(theirs[0].shape) if theirs else [])
    if why is not None:
        raise _C.TierflowError(why)


def refuse_sharded_later(model: torch.nn.Module, config: Any, cpu_optimizer: bool) -> list:
    """At the wrapped model's first forward: fully_shard (or tensor parallelism) applied after wrap. Returns the
    FSDP2 modules, whose unsharded parameters the session then tells the offloader about; raises for settings
    that cannot train them (``cpu_optimizer``: wrap made a CPUAdamW), and for tensor parallelism."""
    modules, params = _sharded(model)
    why = _C.distributed.sharded_later_refusal(config, modules, params, cpu_optimizer)
    if why is not None:
        raise _C.TierflowError(why)
    return fsdp_modules(model) if modules else []


# -- DDP: the steps during backward fed the reduced gradients ----------------------


def _ddp_class() -> Optional[type]:
    return _class("torch.nn.parallel.distributed", "DistributedDataParallel")


def _ddp_inside(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The DDP module that ``model`` is or holds, if any."""
    ddp = _ddp_class()
    if ddp is None:
        return None
    return next((m for m in model.modules() if isinstance(m, ddp)), None)


def _ddp_around(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The DDP whose forward is running ``model`` now, if any (DDP(model) after wrap)."""
    ddp = _ddp_class()
    active = getattr(ddp, "_active_ddp_module", None) if ddp is not None else None
    inner = getattr(active, "module", None)
    if not isinstance(inner, torch.nn.Module):
        return None
    return active if inner is model or any(m is model for m in inner.modules()) else None


class DistributedWatch:
    """What one session still checks at the wrapped model's forwards (check_forward)."""

    def __init__(self, ddp_seen: bool) -> None:
        self.ddp_seen = ddp_seen  # DDP noted: steps during backward already off (or offloading refused)
        self.sharding_checked = False  # FSDP2 after wrap looked for, at the first forward
        self.fsdp_found: list = []  # the FSDP2 modules found there (the session hooks them)
        self.pending = torch.distributed.is_available()  # anything left to check at a forward


def steps_after_backward(optimizer: Any, message: str, stacklevel: int = 2) -> None:
    """Turns ``optimizer``'s steps during backward off for the rest of the run and warns, once."""
    if optimizer.steps_after_backward_only(message):  # False: none to turn off (TIERFLOW_OVERLAP_STEP=off,
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)  # NVMe states), or done already


def _note_ddp(optimizer: Any, ddp: torch.nn.Module, how: str, stacklevel: int) -> None:
    """DDP seen: TIERFLOW_OFFLOAD_GRADIENTS=on refused; the steps during backward fed DDP's reduced gradients
    (tierflow._ddp_feed), or turned off with a warning that says why."""
    if optimizer is None:
        return  # offload_optimizer='none': the user's optimizer steps after backward anyway
    refused = _C.distributed.ddp_offload_gradients_refusal(optimizer.gradients_offloaded(), how)
    if refused is not None:
        raise _C.TierflowError(refused)
    optimizer.partition_across(ddp)  # Note [Partitioned optimizer], before the stream is fed
    if not optimizer.steps_during_backward():
        return  # TIERFLOW_OVERLAP_STEP=off, NVMe states, or turned off already: DDP's reduction as it is
    why = _ddp_feed.why_not_fed(ddp)
    if why is None:
        _ddp_feed.feed(ddp, optimizer)
    else:
        steps_after_backward(optimizer, _C.distributed.ddp_steps_after_backward_warning(how, why), stacklevel + 1)


def check_wrap(optimizer: Any, model: torch.nn.Module) -> DistributedWatch:
    """tierflow.wrap, once its optimizer (a CPUAdamW, or None) is made: DDP inside ``model`` is noted (or refused
    with TIERFLOW_OFFLOAD_GRADIENTS=on); the forwards check the rest (check_forward) with what this returns."""
    ddp = _ddp_inside(model)
    if ddp is not None:
        _note_ddp(optimizer, ddp, "tierflow.wrap of a DDP model", 3)  # the warning points at the caller of wrap
    watch = DistributedWatch(ddp is not None)
    # Sharded before wrap: checked there (refuse_sharded), its CPU optimizer made for the shards.
    watch.sharding_checked = bool(fsdp_modules(model))
    return watch


def check_forward(watch: DistributedWatch, optimizer: Any, module: torch.nn.Module, config: Any) -> None:
    """A forward of the wrapped model, while ``watch.pending``: looks for FSDP2 applied after wrap (first forward,
    before anything is saved: ``watch.fsdp_found``, or refused) and notes a DDP around the wrapped model.
    ``optimizer``: the session's CPUAdamW, or None."""
    if not watch.sharding_checked:
        watch.fsdp_found = refuse_sharded_later(module, config, optimizer is not None)
        watch.sharding_checked = True
    offloading = optimizer is not None and optimizer.gradients_offloaded()
    early = optimizer is not None and (optimizer.steps_during_backward() or optimizer.partition_pending())
    if watch.ddp_seen or not (offloading or early):
        watch.pending = False  # nothing left that DDP would change
        return
    ddp = _ddp_around(module)
    if ddp is not None:
        _note_ddp(optimizer, ddp, "DDP(model) of a model wrapped by tierflow.wrap", 2)
        watch.ddp_seen = True
        watch.pending = False


def note_step(optimizer: Any, before: dict, scale: float) -> None:
    """CPUAdamW.step, after its early steps were committed or redone (``before``: overlap_stats
    before that): every early step redone, none committed, in a multi-process run, means the
    gradients are all-reduced behind tierflow's back; the steps during backward go off."""
    after = optimizer.overlap_stats
    warning = _C.distributed.redone_steps_warning(after["redone"] - before["redone"],
                                                  after["committed"] - before["committed"], float(scale), _world_size())
    if warning is not None:
        steps_after_backward(optimizer, warning, 2)
