"""A drop-in replacement for torch.optim.Adam / AdamW that steps on the CPU.

Its steps during backward are Note [Step during backward]
(optimizer/include/tierflow/optimizer/step_ledger.hpp): the gradients and
weights move in Note [Gradient streaming]
(bindings/include/tierflow/bindings/grad_stream.hpp).

Note [Optimizer copies] (copies.py) says how gradients, parameters and masters move.

Note [Atomic step] (optimizer/include/tierflow/optimizer/step_plan.hpp) says why a step is all or nothing.

Note [Weight content]
~~~~~~~~~~~~~~~~~~~~
The CPU AdamW steps an fp32 master of each weight, kept on the host, and
writes the parameter from it. A user's write to the parameter since then
(p.data.clamp_() after step(), WGAN's weight clipping; p.data edited between
backward() and step(); a copy from an EMA) would be overwritten by the next
step from the old master, where torch's AdamW steps from whatever p holds.
So each parameter is known by its content (Note [Gradient content]: the same
two exact sums): what tierflow last wrote into it, or read from it to make the
master, is compared with its bytes at the next step(). Where they differ, the
master is re-read from p (kept where p is its rounding, as after a load) and
an early step taken from the old master is stepped again. The stream's
parameters are checked in C++ (GradStream: the staging's bytes on the host;
on a GPU the parameter once its compute stream waits for the copy), the
others here. Not checked: parameters that live on the host between uses
(TIERFLOW_OFFLOAD_PARAMS), states on NVMe, and, with
TIERFLOW_WEIGHTS_RETURN=forward, a write between step() and the next forward,
which races the new weights on their way (docs/models.md). The GPU share
steps an fp32 parameter in place (its master is the parameter) and re-reads a
16-bit parameter's master where the parameter is not its rounding.

Note [Shared param groups]
~~~~~~~~~~~~~~~~~~~~~~~~~~
An LR scheduler made before tierflow.wrap holds the optimizer that wrap
replaces, and writes ``lr`` (OneCycleLR also ``betas``; every scheduler
``initial_lr``) into ``scheduler.optimizer.param_groups``. So
CPUAdamW.replace takes that optimizer's group dicts and its param_groups
list themselves, not copies: the CPUAdamW's ``param_groups`` is the very list
the replaced optimizer holds, and load_state_dict (which in torch puts fresh
dicts in a fresh list) refills the same dicts in place. step() marks the
replaced optimizer as stepped (``_opt_called``, which the scheduler's wrapper
of the old ``step`` would have set), so the scheduler does not warn that it
stepped before the optimizer. The hyperparameters are read from the groups at
every step, so a new lr or betas takes effect at the next step() (an early
step during backward with the old ones is redone: Note [Step during
backward]).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from .. import _C
from .. import _fsdp_feed as fsdp_feed
from .._distributed import fsdp_units, rank_and_world_size
from . import clip
from .accepted import GRAD_DTYPES, check_replaceable, check_sharding
from .copies import DeviceCopies, local_shard
from .gpu_share import GpuShare
from . import checkpoint
from .nvme_states import StateTier, fill_lost_states
from .partition import Partition
from .step_paths import StepPaths
from .streaming import GradientStreaming



def _remove_hooks(handles: list) -> None:
    """The hooks a CPUAdamW left on its model, once the optimizer is gone (each holds it weakly)."""
    for h in handles:
        h.remove()
    handles.clear()


class CPUAdamW(StepPaths, torch.optim.Optimizer):
    """Adam / AdamW with fp32 master weights and moments in the pinned host pool.

    The update is tierflow's C++ CpuAdam on oneTBB, with the semantics of
    ``torch.optim.AdamW`` (or ``Adam`` when a group has
    ``decoupled_weight_decay=False``); see Note [Adam semantics]. The updated
    master is written back into each parameter in the parameter's dtype. Its
    ``state_dict`` has torch's layout plus an fp32 ``master`` per parameter,
    and loads into ``torch.optim.AdamW``; torch's loads into it.

    ``exp_avg`` and ``exp_avg_sq`` are kept in the format TIERFLOW_OPTIMIZER_STATES
    (keyword ``optimizer_states``: fp32, bf16 or 8bit; Note [Optimizer state
    formats]) names; the format of a moment is its dtype (float32, bfloat16, or
    one uint8 buffer of codes and scales). The state dict carries the format
    (checkpoint.py: 8-bit moments as ``exp_avg_codes``/``exp_avg_sq_codes`` and their scales, which
    torch.optim.AdamW does not load) and a load converts any format into this optimizer's.
    """

    def __init__(self, params: Any, runtime: "_C.Runtime", lr: float = 1e-3,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = True, optimizer_states: Optional[str] = None) -> None:
        # None: the runtime's TIERFLOW_OPTIMIZER_STATES (tierflow.wrap's keyword optimizer_states sets it).
        self._states_keyword = optimizer_states
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self._setup(runtime)

    # -- construction from an existing optimizer ---------------------------------
    check_replaceable = staticmethod(check_replaceable)

    @classmethod
    def replace(cls, optimizer: torch.optim.Optimizer, runtime: "_C.Runtime",
                model: Optional[torch.nn.Module] = None) -> "CPUAdamW":
        """A CPUAdamW with ``optimizer``'s groups (the same dicts: Note [Shared param groups]),
        hyperparameters and state; what it accepts: check_replaceable."""
        cls.check_replaceable(optimizer)
        adamw = type(optimizer) is torch.optim.AdamW
        defaults = dict(optimizer.defaults)
        new = cls.__new__(cls)
        # Note [Shared param groups]: the very dicts (and list) of the replaced optimizer, not copies.
        groups = optimizer.param_groups
        for g in groups:
            g.setdefault("decoupled_weight_decay", adamw)
            if adamw:
                g["decoupled_weight_decay"] = True
        defaults.setdefault("decoupled_weight_decay", adamw)
        torch.optim.Optimizer.__init__(new, list(groups), defaults)
        if any(a is not b for a, b in zip(new.param_groups, groups)) or len(new.param_groups) != len(groups):
            raise _C.TierflowError(
                "tierflow.wrap: the CPU optimizer could not share the param groups of the optimizer it replaces, "
                "so an LR scheduler made on that optimizer would change nothing; create LR schedulers after "
                "tierflow.wrap, on the optimizer it returns")
        groups[:] = new.param_groups
        new.param_groups = groups  # one list: groups added later are seen through either optimizer
        new._replaced = weakref.ref(optimizer)
        if model is not None:  # names for error messages
            new._names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        new._setup(runtime)
        if len(optimizer.state) > 0:
            new.load_state_dict(optimizer.state_dict())
        if model is not None:
            # model.load_state_dict(...) changes parameters behind the optimizer's back. Held weakly: the model
            # must not keep the optimizer, and with it the runtime (its pinned pool, states and claim on the stall
            # limit), alive after unwrap (Note [Session lifetime]); the hooks on the model go with the optimizer.
            me = weakref.ref(new)

            def stale(module: torch.nn.Module, keys: Any) -> None:
                opt = me()
                if opt is not None:
                    opt.mark_master_stale()

            new._hooks.append(model.register_load_state_dict_post_hook(stale))
            if new._sharded:  # step() waits for the shards' weights: FSDP2 gathers them in its own pre-forward
                new._stream_fsdp_shards(model)
            elif new._streaming is not None and runtime.settings().weights_return_in_forward:
                new._hooks += new._streaming.attach_weight_waits(model)
            elif new._streaming is not None:
                new._hooks += new._streaming.attach_step_wait(model)
            weakref.finalize(new, _remove_hooks, new._hooks)  # the model's hooks go with the optimizer
        return new

    def _setup(self, runtime: "_C.Runtime") -> None:
        self._runtime = runtime
        self._master_stale = False
        self._written: dict = {}    # Note [Weight content]: id(p) -> what the Python path last wrote into p
        self._reread: set = set()   # ids of parameters whose masters this step re-reads (written by the user)
        self._stream_stepped: list = []  # the stream's slots this step steps in the Python path
        self._python_stepped: list = []  # the parameters this step writes in the Python path
        # Note [Step stats]: step()'s CPU optimizer time in the Python path (the host-tier groups' preparation and
        # kernels, the NVMe tier's steps), cumulative ns; the gradient stream counts its own (step_wait_ms and
        # step_kernel_ms). tierflow.step_stats() and report()["plan"]["terms"] read the two together.
        self.python_step_ns = 0
        cfg = runtime.settings()  # typed (Note [Typed settings])
        if not hasattr(self, "_names"):
            self._names: dict = {}
        # Note [Step plan]: the states' tier and format (Note [Optimizer state formats]), steps during backward
        # (FSDP2's DTensor shards step in step() until wrap streams them: Note [Distributed training]), the GPU
        # share's setting, each step()'s path; TIERFLOW_OFFLOAD_GRADIENTS=on without those steps is refused.
        keyword = getattr(self, "_states_keyword", None)
        self._plan = _C.StepPlan(cfg, None if keyword is None else str(keyword),
                                 check_sharding(self.param_groups, self._names, self._runtime, cfg))
        for i, group in enumerate(self.param_groups):
            self.check_amsgrad(group, i)
        self._copies = DeviceCopies(runtime)  # Note [Optimizer copies]
        # host pool or NVMe: Note [NVMe optimizer faults]; the moments in this optimizer's format
        self._states = StateTier(runtime, self._plan, self._names)
        # Note [Partitioned optimizer]: under DDP with several ranks, this rank's share of the parameters only.
        self._partition: Optional[Partition] = None
        self._partition_wanted = cfg.partition_optimizer
        self._loaded_layout: Optional[tuple] = None  # a state dict's share, loaded before the partition was made
        self._accumulation = int(cfg.grad_accumulation_steps)
        self._max_grad_norm = cfg.max_grad_norm  # None: no clipping
        self._skip_nonfinite = cfg.skip_nonfinite
        # Note [Gradient streaming]: device gradients freed once on the host; p.grad is None until step().
        self._offload_grads = cfg.offload_gradients
        # GradScaler then hands step() its scale and found_inf instead of stepping blind: step() refuses.
        self._step_supports_amp_scaling = self._offload_grads
        self._hooks = []
        self._gpu = GpuShare(self._plan.gpu_share_setting, state_format=self._state_format)  # Deep Optimizer States
        self._overlap_counts = {"early_steps": 0, "committed": 0, "redone": 0, "taken_back": 0, "held": 0,
                                "skipped_steps": 0}
        # Note [Gradient streaming]: parameters of the runtime's device stream their
        # gradients from a C++ hook and step during backward (Note [Step ledger]);
        # the rest (a CPU model beside a CUDA runtime) step in step().
        self._streaming: Optional[GradientStreaming] = None
        if not self._gpu.auto:
            self._gpu.ensure(self.param_groups)
        if self._overlap:
            self._start_streaming(runtime)
        # Partitioned, this rank holds its share only: checked (and NVMe space reserved) once the share is known.
        self._space_pending = self.partition_pending() and rank_and_world_size()[1] > 1
        if not self._space_pending:
            self._states.check_space(self.param_groups, self._gpu.ids or set())

    def _start_streaming(self, runtime: "_C.Runtime") -> None:
        """The gradient stream for the parameters of the runtime's device."""
        streaming = self._streaming = GradientStreaming(runtime, self._accumulation, self._max_grad_norm,
                                                        self._skip_nonfinite, self._offload_grads)
        gpu = self._gpu.ids or set()
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                route = self._plan.route(p.requires_grad, streaming.carries(p), runtime.on_device(local_shard(p)),
                                         p.is_contiguous(), p.dtype in GRAD_DTYPES, id(p) in gpu)
                if route == _C.ParamRoute.feed:  # FSDP2: the local tensor steps, fed its reduce-scattered gradient
                    streaming.add_fed_parameter(p, local_shard(p), gi)
                elif route == _C.ParamRoute.stream:
                    streaming.add_parameter(p, gi)
        begin = weakref.WeakMethod(self._on_backward_begin)
        init = weakref.WeakMethod(self._init_slot)
        streaming.stream.set_callbacks(lambda: begin() and begin()(), lambda slot: init() and init()(slot))
        self._push_groups()
        clip.watch(streaming)  # the user's clip, instead of tierflow's or as a norm read: Note [Clip picked up]

    def _stream_fsdp_shards(self, model: torch.nn.Module) -> None:
        """FSDP2 under wrap (Note [Distributed training]): each rank's shards step during backward, fed each unit's
        reduce-scattered gradients as FSDP2 assigns them (tierflow._fsdp_feed); step() only confirms."""
        if not self._plan.stream_shards():
            return
        self._start_streaming(self._runtime)
        units = [(u, [p for p in params if self._streaming.carries(p)]) for u, params in fsdp_units(model)]
        # Kept by the stream, which the user's clip asks too (Note [Clip picked up]).
        self._streaming.fsdp_feed = fsdp_feed.attach(model, self, [(u, ps) for u, ps in units if ps])

    @property
    def _fsdp_feed(self) -> Any:
        """FSDP2: the feed of each unit's reduce-scattered gradients (tierflow._fsdp_feed), once wrap showed the
        units; None otherwise."""
        streaming = getattr(self, "_streaming", None)
        return streaming.fsdp_feed if streaming is not None else None

    def detach_model(self) -> None:
        """tierflow.unwrap: the FSDP2 feed's hooks go (its shards step in step() from now on). The model's other
        hooks (the weight waits, the load_state_dict mark) hold this optimizer weakly and stay while it lives: it
        may still step the unwrapped model (Note [Session lifetime]); they go with it."""
        if self._fsdp_feed is not None:
            self._fsdp_feed.remove()

    @property
    def overlap_stats(self) -> dict:
        """Counts of steps taken during backward: early_steps, committed, redone, taken_back, held, skipped_steps."""
        out = dict(self._overlap_counts)
        if self._streaming is not None:
            s = self._streaming.stream.stats()
            for k in ("early_steps", "committed", "redone", "taken_back", "held"):
                out[k] += s[k]
        return out

    def _mark_step_called(self) -> None:
        """Note [Shared param groups]: a scheduler made on the replaced optimizer wrapped *its* step to note
        that it was called; mark it, so the scheduler does not warn that it stepped before the optimizer."""
        ref = getattr(self, "_replaced", None)
        old = ref() if ref is not None else None
        if old is not None:
            old._opt_called = True

    def check_amsgrad(self, group: dict, index: int) -> None:
        """amsgrad keeps fp32 moments: refused with bf16 or 8-bit ones, naming the setting (Note [Step plan])."""
        plan = getattr(self, "_plan", None)  # None inside torch's __init__, before _setup
        if plan is not None:
            plan.check_amsgrad(bool(group.get("amsgrad")), index)

    # What the plan decided (Note [Step plan]), as the step paths and the feeds read it.
    _state_format = property(lambda self: self._plan.format)
    _sharded = property(lambda self: self._plan.sharded)
    _overlap = property(lambda self: self._plan.overlap)
    _steps_after_backward = property(lambda self: self._plan.steps_after_backward)  # why they are off, or None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self.check_amsgrad(self.param_groups[-1], len(self.param_groups) - 1)
        except BaseException:
            self.param_groups.pop()
            raise
        streaming = getattr(self, "_streaming", None)  # None inside torch's __init__, before _setup
        if streaming is not None:
            streaming.forget_python_path()  # its parameters step through the Python path
        if hasattr(self, "_plan"):  # after _setup: the same rules for the new group's parameters
            try:
                self._plan.check_group_sharding(check_sharding(self.param_groups, self._names, self._runtime,
                                                               self._runtime.settings()))
            except BaseException:
                self.param_groups.pop()
                raise

    def use_host_copies(self, offload: Any) -> None:
        """Parameters that live on the host between uses (Note [Parameter hooks]): their steps read and
        write the host copies, and the stream commits their weights there. The GPU share (auto) takes none."""
        self._copies.homes = offload
        if self._gpu.auto:
            self._gpu = GpuShare("0", state_format=self._state_format)
        if self._streaming is not None:
            self._streaming.use_homes(offload)

    def follow_activation_plan(self, planner: Any) -> None:
        """tierflow.wrap under the activation planner (auto; held weakly): the GPU share (auto) is chosen once
        the plan is in force, in the room it leaves, and the plan settles if the share takes device memory
        (Note [Steady step])."""
        self._planner = weakref.ref(planner)

    def activation_planner(self) -> Any:
        """The activation planner follow_activation_plan gave, or None."""
        ref = getattr(self, "_planner", None)
        return ref() if ref is not None else None

    def params_became_resident(self, params: list) -> None:
        """TIERFLOW_OFFLOAD_PARAMS=auto's plan keeps these on the device now: their weights go there again."""
        if self._streaming is not None:
            self._streaming.drop_homes(params)

    def mark_master_stale(self) -> None:
        """Parameters were changed outside the optimizer: re-read masters from them at the next step."""
        self._master_stale = True

    fill_lost_states = staticmethod(fill_lost_states)

    # -- distributed training (Note [Distributed training]) ----------------------------
    def gradients_offloaded(self) -> bool:
        """True with TIERFLOW_OFFLOAD_GRADIENTS=on: p.grad is None from backward to step()."""
        return self._offload_grads

    def steps_during_backward(self) -> bool:
        """True while parameters step during backward (Note [Step during backward])."""
        return self._plan.steps_during_backward()

    def steps_after_backward_only(self, why: str) -> bool:
        """Turns the steps during backward off for the rest of the run (``why``: the reason); False when there
        were none to turn off (TIERFLOW_OVERLAP_STEP=off, states on NVMe) or they were off already."""
        if not self._plan.stop_steps_during_backward(why):
            return False
        if self._streaming is not None:
            self._streaming.stream.set_enabled(False)  # _on_backward_begin keeps it off from now on
        return True

    def partition_across(self, ddp: torch.nn.Module) -> bool:
        """Note [Partitioned optimizer]: the DDP module ``ddp`` was seen, before the first
        backward. With TIERFLOW_PARTITION_OPTIMIZER=on and several ranks, this rank keeps the states of and steps
        only the parameters it owns (the others leave the gradient stream; states of theirs that a loaded state
        dict brought are dropped, another rank's partition alone is refused), and step() broadcasts every
        parameter's new weights from its owner. Returns whether it partitioned (now or before)."""
        if self._partition is not None:
            return True
        if not self._partition_wanted or self._sharded or torch.distributed.get_world_size(ddp.process_group) < 2:
            return False
        part = Partition([p for g in self.param_groups for p in g["params"]], ddp)
        part.check_loaded(self.state, self._loaded_layout)
        part.drop_others(self.state)
        if self._streaming is not None:
            for p in part.params:
                if not part.owns(p) and self._streaming.carries(p):
                    self._streaming.exclude(p)  # the stream lets go of its states too
            self._streaming.forget_python_path()
        self._partition = part
        self._check_space_once()
        return True

    def _check_space_once(self) -> None:
        """The states' room (and NVMe space), checked for the parameters this rank steps, once."""
        if self._space_pending:
            self._space_pending = False
            self._states.check_space([dict(g, params=[p for p in g["params"] if self.owns(p)])
                                      for g in self.param_groups], self._gpu.ids or set())

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank keeps p's states and steps it: every parameter, unless the optimizer is partitioned
        across DDP's ranks (Note [Partitioned optimizer]), where only those this rank owns."""
        return self._partition is None or self._partition.owns(p)

    def partition_pending(self) -> bool:
        """Whether DDP, once seen, would partition this optimizer (it has not yet)."""
        return self._partition_wanted and self._partition is None and not self._sharded

    def partition_stats(self) -> Optional[dict]:
        """This rank's share (Note [Partitioned optimizer]) and the weights' broadcasts, or None."""
        return dict(self._partition.stats) if self._partition is not None else None

    def state_stats(self) -> dict:
        """What the states hold (Note [Optimizer state formats]): the moments' format, the parameters and
        elements with a state, and the bytes of their masters and moments on the host (or reserved on NVMe)."""
        elements, nbytes, count = 0, 0, 0
        for group in self.param_groups:
            for p in group["params"]:
                s = self.state.get(p)
                if not s:
                    continue
                shard = local_shard(p)
                count += 1
                elements += shard.numel()
                if self._states.nvme:
                    nbytes += _C.optimizer_state_bytes(shard.numel(), bool(group["amsgrad"]), self._state_format)
                    continue
                # Sizes only: a parameter living on the host between uses refuses any access to its data.
                nbytes += sum(t.nbytes for k, t in s.items()
                              if k in ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq") and
                              isinstance(t, torch.Tensor))
        return {"format": self._state_format, "parameters": count, "elements": elements, "bytes": nbytes,
                "tier": self._plan.tier}

    # -- what DDP's and FSDP2's feeds and checkpoint.py use (never a private attribute) ---------------------
    @property
    def streaming(self) -> Optional[GradientStreaming]:
        """The gradient stream (optim/streaming.py, Note [Gradient streaming]) the feeds hand reduced gradients
        to, or None when it is off."""
        return getattr(self, "_streaming", None)

    @property
    def state_format(self) -> str:
        """The moments' format: fp32, bf16 or 8bit (Note [Optimizer state formats])."""
        return self._state_format

    @property
    def sharded(self) -> bool:
        """Whether the parameters are FSDP2's DTensor shards, each rank's stepped there (Note [Distributed
        training])."""
        return self._sharded

    @property
    def states_on_nvme(self) -> bool:
        """Whether the states live on NVMe (Note [NVMe optimizer faults]), not in the pinned host pool."""
        return self._states.nvme

    @property
    def partition(self) -> Optional[Partition]:
        """This rank's share under DDP (Note [Partitioned optimizer]), or None: it steps every parameter."""
        return self._partition

    @property
    def master_stale(self) -> bool:
        """Whether the next step re-reads each master from its parameter (kept where the parameter is its
        rounding): set after the model or the optimizer was loaded."""
        return self._master_stale

    @master_stale.setter
    def master_stale(self, stale: bool) -> None:
        self._master_stale = bool(stale)

    def keep_loaded_layout(self, layout: Optional[tuple]) -> None:
        """A loaded state dict's share (Note [Partitioned optimizer]), checked when the partition is made."""
        self._loaded_layout = layout

    def settle_before_load(self) -> None:
        """Before a load replaces the states: the early steps finished (or taken back), this backward's
        gradients back in p.grad for the next step(), the window ended and the weights back."""
        if self._streaming is not None:
            self._wait_worker()
            self._streaming.stream.restore_grads()
            self._streaming.stream.end_window()
            self._streaming.stream.synchronize()

    def describe(self, p: torch.Tensor) -> str:
        """p as a user knows it (its name, or its group and index), for error messages."""
        return self._states.describe(p, self.param_groups)

    def exportable_state(self, p: torch.Tensor) -> dict:
        """p's state as CPU tensors a state dict can hold: the live one on the host; on NVMe read back, or
        marked lost (Note [NVMe optimizer faults])."""
        if not self._states.nvme:
            return self.state[p]
        return self._states.materialize_or_mark(p, self.state[p], self.param_groups)

    def tier_stores(self) -> dict:
        """{p: where its state lives on NVMe} (empty on the host): a load writes them again in place."""
        return self._states.stores(self.state)

    def weight_source(self, p: torch.Tensor) -> torch.Tensor:
        """What p holds, where the optimizer reads it (the host copy of a parameter living on the host)."""
        return self._copies.source(p)

    def host_moment(self, shard: torch.Tensor) -> torch.Tensor:
        """A new moment for ``shard`` in the pinned pool, in this optimizer's format."""
        return self._copies.host_moment(shard, self._state_format)

    def host_tensor(self, shard: torch.Tensor, zero: bool) -> torch.Tensor:
        """A new fp32 tensor shaped like ``shard`` in the pinned pool (zeros when ``zero``)."""
        return self._copies.host(shard, zero)

    def place_state(self, p: torch.Tensor, group: dict, store: Any = None) -> None:
        """p's state (new or replaced, in host tensors) to its tier: written to NVMe (into ``store``, where it
        lived before, when given), or handed to the gradient stream."""
        if self._states.nvme:
            self._states.reserve([(p, group)])
            self._states.to_nvme(p, self.state[p], group, store)
        else:
            self._register_state(p)

    # -- the gradient stream (Note [Gradient streaming]) ------------------------------
    @property
    def _stream(self) -> Optional["_C.GradStream"]:
        """The C++ gradient stream, or None when it is off."""
        return self._streaming.stream if self._streaming is not None else None

    @property
    def _gpu_share(self) -> Optional[set]:
        """Ids of the CUDA parameters that step on the GPU (None until the first step decides)."""
        return self._gpu.ids

    def stream_stats(self) -> dict:
        """The gradient stream's counters and times (Note [Gradient streaming]); empty when it is off."""
        out = dict(self._streaming.stream.stats()) if self._streaming is not None else {}
        if out:
            out["gpu_optimizer_fraction"] = self._gpu.fraction
            out["last_window"] = self._streaming.stream.last_window()  # Note [Stream timeline]
        return out

    def synchronize(self) -> None:
        """Waits until every updated weight is back on the device (TIERFLOW_WEIGHTS_RETURN=forward).

        Forwards of the wrapped model, its state_dict and load_state_dict, and
        this optimizer's state_dict and step wait by themselves; call this before
        reading parameters any other way between step() and the next forward.
        """
        if self._streaming is not None:
            self._streaming.stream.synchronize()

    def _push_groups(self) -> None:
        for i, group in enumerate(self.param_groups):  # a group's amsgrad set after construction: refused here,
            self.check_amsgrad(group, i)              # before the stream steps with it
        self._streaming.push_groups([self._options(group) for group in self.param_groups])

    def _on_backward_begin(self) -> None:
        """Once per backward, from C++: the hyperparameters in force (an LR scheduler may have changed them)."""
        self._push_groups()
        # Under DDP every parameter steps in step(), from the reduced gradient (Note [Distributed training]).
        self._streaming.stream.set_enabled(self._plan.steps_during_backward(self._master_stale))

    @torch.no_grad()
    def _init_slot(self, slot: int) -> None:
        """From C++, the first time a parameter streams: its state (first step only)."""
        p = self._streaming.param_of(slot)
        state = self.state[p]
        if len(state) == 0:
            self._init_state(p, self._group_of(p))
        else:
            self._register_state(p)

    def _register_state(self, p: torch.Tensor) -> None:
        """Gives the C++ stream p's state tensors (after they were created or replaced)."""
        if self._streaming is not None:
            self._streaming.set_state(p, self.state[p])

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's layout; ``master`` is included only for non-fp32 parameters
        (for fp32 ones the parameter itself is the master). States on NVMe are
        read back into CPU tensors, so checkpoints hold them too (checkpoint.py)."""
        self.synchronize()
        return checkpoint.state_dict_of(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a CPUAdamW or torch Adam/AdamW state dict, keeping fp32 precision; moments of another format
        are converted to this optimizer's (one log line says so). Refuses one with
        states marked lost (Note [NVMe optimizer faults]), naming them (checkpoint.py)."""
        checkpoint.load(self, state_dict, super().load_state_dict)

    # -- step during backward (Note [Step during backward]) ----------------------
    @staticmethod
    def _options(group: dict) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                    decoupled_weight_decay=bool(group.get("decoupled_weight_decay", True)))

    def _group_of(self, p: torch.Tensor) -> Optional[dict]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        return None

    def _wait_worker(self) -> None:
        """Waits for the stream's early steps; if one failed, takes all of them back before raising."""
        if self._streaming is None:
            return
        try:
            self._streaming.stream.wait_worker()
        except Exception:
            self._streaming.stream.discard_all()
            raise

    def has_unconfirmed_steps(self) -> bool:
        """True while parameters hold early steps that no step() has confirmed."""
        return self._streaming is not None and self._streaming.stream.has_unconfirmed()

    @torch.no_grad()
    def take_back_unconfirmed(self) -> None:
        """Restores every parameter stepped early but not confirmed (wrap() calls this before a forward)."""
        if self._streaming is not None:
            self._streaming.stream.discard_all()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; also takes back early steps that no step() confirmed."""
        if self._streaming is not None:
            self._streaming.stream.end_window()
        self._states.new_window()  # a new window: the next step() is a step for everyone
        super().zero_grad(set_to_none=set_to_none)
        if self._fsdp_feed is not None:  # the shards let go of the gradients too
            self._fsdp_feed.sync_grads()

    # -- step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adam/AdamW step over every parameter that has a gradient."""
        if self._offload_grads and hasattr(self, "found_inf"):
            # torch.amp.GradScaler (see _step_supports_amp_scaling) unscaled and checked only the
            # gradients still in p.grad: the released ones would step scaled and unchecked.
            for attr in ("found_inf", "grad_scale"):  # the scaler deletes them only after a step
                self.__dict__.pop(attr, None)
            raise _C.TierflowError(_C.grad_scaler_refusal())
        if self._partition is not None:
            self._partition.refuse_join()
        for i, group in enumerate(self.param_groups):  # a group's amsgrad set after construction
            self.check_amsgrad(group, i)
        self._check_space_once()  # a multi-process run that never showed its DDP: every parameter's states here
        self._mark_step_called()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._partition is None:
            self._step_all()
        else:  # Note [Partitioned optimizer]: the ranks agree on how the step went, then the owners' weights move
            try:
                skipped = self._step_all()
            except BaseException:
                self._partition.agree(failed=True, skipped=False)
                raise
            self._partition.agree(failed=False, skipped=skipped)
            if not skipped:
                self.synchronize()
                self._partition.broadcast()
        self._copies.bump_offloaded_versions(self.param_groups)
        self._master_stale = False
        return loss
