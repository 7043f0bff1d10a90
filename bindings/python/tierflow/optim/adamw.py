"""A drop-in replacement for torch.optim.Adam / AdamW that steps on the CPU.

Note [Step during backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
As in Fuyou, a parameter's CPU update starts as soon as backward has
finished its gradient (a post-accumulate-grad hook), on tierflow's optimizer
worker thread, while backward goes on with earlier layers. The catch is that
some decisions need every gradient first: global-norm clipping (a scale
applied to all gradients), skipping a step when a gradient is inf/NaN (AMP's
GradScaler), and user code that changes gradients between backward() and
step() (torch.nn.utils.clip_grad_norm_, GradScaler.unscale_, gradient
accumulation that continues).

tierflow steps speculatively and can take any step back, exactly, at no
extra memory traffic: the overlapped update writes the new master, m and v
out of place into fresh pinned-pool buffers (the kernel reads the old ones
and writes the new ones, the same 28 bytes per parameter as in place) and
keeps the old ones. step() then checks, for every parameter stepped early,
that its gradient is the same tensor at the same version (in-place changes
bump it), that the hyperparameters did not change, and that no global
decision alters the step: the clip coefficient, computed with the same torch
ops as clip_grad_norm_, is exactly 1, and no gradient is non-finite when
TIERFLOW_SKIP_NONFINITE is on. If so the new buffers are committed (a
pointer swap) and the old ones return to the pool. If not, the old buffers
are kept, the parameter is restored from the old master, and the step is
redone from the gradient as it is now, scaled by the clip coefficient, or
skipped. A step() that never comes (GradScaler skipping it) is taken back by
zero_grad() or by the wrapped model's next forward (a forward before step()
means that backward was not the last one). The cost is 12 bytes per parameter of
pinned memory held between a gradient's completion and step(); when the pool
cannot hold it, that parameter is simply stepped in step(). With gradient
accumulation, TIERFLOW_GRAD_ACCUMULATION_STEPS says which backward is the
last one before step(); a wrong value only costs redone steps.

For parameters of the runtime's device (CUDA tensors, or CPU tensors on the
emulated device) all of this runs in C++, bucket by bucket, with no Python per
parameter: Note [Gradient streaming] in
bindings/include/tierflow/bindings/grad_stream.hpp. The per-parameter Python
hook below serves only a CPU model beside a CUDA runtime.

Between backward() and step() a parameter on the CPU (a CPU model beside a
CUDA runtime) already holds its new value; step() restores any that it takes
back. A parameter of the runtime's device (a CUDA tensor, or a CPU tensor on
the emulated device) gets its new value in step(), when the step is confirmed.

Note [Optimizer copies]
~~~~~~~~~~~~~~~~~~~~~~~
Every gradient, parameter and master that moves between the runtime's device
and the host goes through tierflow's copy engine, on CUDA and on the emulated
device alike, so the adversarial emulated device checks this path too
(Note [Copy ordering] in swap/include/tierflow/swap/copy_engine.hpp):
- a gradient is copied to pinned memory after the work queued on the current
  stream: in a post-accumulate-grad hook (C++ for device parameters: its slice
  of a bucket) that is the stream backward produced it on; the CPU step waits
  for the copy before it reads the gradient, and the device gradient is kept
  referenced until then (with TIERFLOW_OFFLOAD_GRADIENTS=on p.grad is None at
  once and that reference, the last, goes right then: Note [Gradient
  streaming]);
- an updated parameter goes back from pinned staging after the work queued on
  the current stream (kernels still reading the old value), the stream waits
  for it before its next kernel, and step() waits for every upload before the
  staging returns to the pool.

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
from .gpu_share import GpuShareMixin
from .nvme_states import LOST_STATE, NvmeStatesMixin
from .streaming import StreamingMixin

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_grad(grad: torch.Tensor) -> None:
    """Refuses a gradient the CPU kernels cannot take, naming what they accept."""
    if grad.is_sparse or grad.dtype not in _GRAD_DTYPES:
        raise _C.TierflowError(f"tierflow CPUAdamW: a {'sparse ' if grad.is_sparse else ''}{grad.dtype} gradient "
                               "is not supported; accepted: dense float32, bfloat16 or float16")


class CPUAdamW(StreamingMixin, GpuShareMixin, NvmeStatesMixin, torch.optim.Optimizer):
    """Adam / AdamW with fp32 master weights and moments in the pinned host pool.

    The update is tierflow's C++ CpuAdam on oneTBB, with the semantics of
    ``torch.optim.AdamW`` (or ``Adam`` when a group has
    ``decoupled_weight_decay=False``); see Note [Adam semantics]. The updated
    master is written back into each parameter in the parameter's dtype. Its
    ``state_dict`` has torch's layout plus an fp32 ``master`` per parameter,
    and loads into ``torch.optim.AdamW``; torch's loads into it.
    """

    def __init__(self, params: Any, runtime: "_C.Runtime", lr: float = 1e-3,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self._setup(runtime)

    # -- construction from an existing optimizer ---------------------------------
    @staticmethod
    def check_replaceable(optimizer: torch.optim.Optimizer) -> None:
        """Accepts exactly ``torch.optim.AdamW`` and ``torch.optim.Adam``; anything
        else (another algorithm, or a subclass that may change ``step``) raises
        ``TierflowError`` naming it and what is accepted.
        """
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
            cls_ = type(optimizer)
            public = getattr(torch.optim, cls_.__name__, None) is cls_
            name = f"torch.optim.{cls_.__name__}" if public else f"{cls_.__module__}.{cls_.__qualname__}"
            raise _C.TierflowError(
                f"tierflow.wrap: cannot replace an optimizer of type {name}; "
                "accepted: torch.optim.AdamW, torch.optim.Adam. "
                "Pass offload_optimizer='none' to keep your optimizer on the device.")
        for i, g in enumerate(optimizer.param_groups):
            if g.get("differentiable"):
                raise _C.TierflowError(f"tierflow.wrap: param group {i} has differentiable=True, "
                                       "which the CPU optimizer cannot honour; accepted: differentiable=False")
            for p in g["params"]:
                if not p.is_floating_point() or p.dtype not in _GRAD_DTYPES:
                    raise _C.TierflowError(f"tierflow.wrap: param group {i} holds a parameter of dtype {p.dtype}; "
                                           "accepted: float32, bfloat16, float16")

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
            # model.load_state_dict(...) changes parameters behind the optimizer's back.
            model.register_load_state_dict_post_hook(lambda module, keys: new.mark_master_stale())
            if new._stream is not None and runtime.config()["TIERFLOW_WEIGHTS_RETURN"] == "forward":
                new._attach_weight_waits(model)
            elif new._stream is not None:
                new._attach_step_wait(model)
        return new

    def _setup(self, runtime: "_C.Runtime") -> None:
        self._runtime = runtime
        self._master_stale = False
        cfg = runtime.config()
        self._cfg = cfg
        self._nvme = cfg["TIERFLOW_OFFLOAD_OPTIMIZER"] == "nvme"
        if not hasattr(self, "_names"):
            self._names: dict = {}
        # Note [NVMe optimizer faults]: param -> (gradient, its version, step count after) of a step taken.
        self._nvme_done: dict = {}
        self._reserved: set = set()  # ids of parameters whose NVMe state space is reserved
        # With states on NVMe, step() streams them through pinned memory
        # (Note [Optimizer states on NVMe]); steps during backward are host-tier only.
        self._overlap = cfg["TIERFLOW_OVERLAP_STEP"] == "on" and not self._nvme
        # Why steps during backward are off for the rest of the run (DDP: Note [Distributed training]), or None.
        self._steps_after_backward: Optional[str] = None
        self._accumulation = int(cfg["TIERFLOW_GRAD_ACCUMULATION_STEPS"])
        norm = cfg["TIERFLOW_MAX_GRAD_NORM"]
        self._max_grad_norm = None if norm == "none" else float(norm)
        self._skip_nonfinite = cfg["TIERFLOW_SKIP_NONFINITE"] == "on"
        # Note [Gradient streaming]: device gradients freed once on the host; p.grad is None until step().
        self._offload_grads = cfg["TIERFLOW_OFFLOAD_GRADIENTS"] == "on"
        # GradScaler then hands step() its scale and found_inf instead of stepping blind: step() refuses.
        self._step_supports_amp_scaling = self._offload_grads
        if self._offload_grads and not self._overlap:
            raise _C.ConfigError(
                "TIERFLOW_OFFLOAD_GRADIENTS=on frees gradients as they stream to the CPU step during backward, "
                f"which needs TIERFLOW_OVERLAP_STEP=on (it is {cfg['TIERFLOW_OVERLAP_STEP']}) and optimizer "
                f"states on the host, TIERFLOW_OFFLOAD_OPTIMIZER=host (it is {cfg['TIERFLOW_OFFLOAD_OPTIMIZER']}); "
                "accepted: those two settings, or TIERFLOW_OFFLOAD_GRADIENTS=off")
        self._spec: dict = {}          # param -> speculative step in flight or done
        self._grad_events: dict = {}   # param -> gradients completed since the last step()
        self._hooks = []
        # TIERFLOW_GRAD_BUCKET_BYTES=auto: sized from measured speeds after the first streamed step.
        self._buckets_unsized = cfg["TIERFLOW_GRAD_BUCKET_BYTES"] == "auto"
        self._streamed_steps = 0  # steps whose gradients streamed (sizing waits for the second)
        fraction = cfg["TIERFLOW_GPU_OPTIMIZER_FRACTION"]
        self._gpu_fraction_auto = fraction == "auto"  # chosen after the first step (_choose_gpu_share)
        self._gpu_fraction = 0.0 if self._gpu_fraction_auto else float(fraction)
        self._gpu_share: Optional[set] = None  # ids of CUDA params stepped on the GPU, fixed at the first step
        self._pending_uploads: list = []       # (transfer, staging) of parameters on their way to the device
        self._overlap_counts = {"early_steps": 0, "committed": 0, "redone": 0, "taken_back": 0, "held": 0,
                                "skipped_steps": 0}
        # Note [Gradient streaming]: parameters of the runtime's device stream their
        # gradients from a C++ hook; the rest (a CPU model beside a CUDA runtime) keep
        # the per-parameter Python hook below.
        self._stream = None
        self._slot_of: dict = {}            # param -> slot of the C++ stream
        self._slot_params: list = []        # slot -> param
        self._python_params: Optional[list] = None  # per group: params that step() handles in Python
        if not self._gpu_fraction_auto:
            self._gpu_share = self._assign_gpu_share()
        if self._overlap:
            # The parameters hold the hook; through a weak reference, so that the
            # optimizer (and its pinned states) goes when the user drops it: a
            # bound method would make a cycle through autograd that the garbage
            # collector cannot see.
            me = weakref.WeakMethod(self._on_grad_ready)

            def hook(p: torch.Tensor) -> None:
                method = me()
                if method is not None:
                    method(p)

            bucket = cfg["TIERFLOW_GRAD_BUCKET_BYTES"]
            self._stream = _C.GradStream(runtime, 0 if bucket == "auto" else int(bucket), self._accumulation,
                                         self._max_grad_norm or 0.0, self._skip_nonfinite,
                                         cfg["TIERFLOW_WEIGHTS_RETURN"] == "forward",
                                         self._offload_grads)
            gpu = self._gpu_share or set()
            for gi, group in enumerate(self.param_groups):
                for p in group["params"]:
                    if not p.requires_grad or p in self._slot_of:
                        continue
                    if (runtime.on_device(p) and p.is_contiguous() and p.dtype in _GRAD_DTYPES
                            and id(p) not in gpu):
                        self._slot_of[p] = self._stream.add_parameter(p, gi)
                        self._slot_params.append(p)
                    elif p.device.type == "cpu" or runtime.on_device(p):
                        self._hooks.append(p.register_post_accumulate_grad_hook(hook))
            begin = weakref.WeakMethod(self._on_backward_begin)
            init = weakref.WeakMethod(self._init_slot)
            self._stream.set_callbacks(lambda: begin() and begin()(),
                                       lambda slot: init() and init()(slot))
            self._push_groups()
            if self._max_grad_norm is None:  # the user may clip instead: Note [Clip picked up]
                from . import clip as _clip

                _clip.watch(self)
        self._check_space()

    @property
    def overlap_stats(self) -> dict:
        """Counts of steps taken during backward: early_steps, committed, redone, taken_back, held, skipped_steps."""
        out = dict(self._overlap_counts)
        if self._stream is not None:
            s = self._stream.stats()
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

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._python_params = None  # its parameters step through the Python path

    def mark_master_stale(self) -> None:
        """Parameters were changed outside the optimizer: re-read masters from them at the next step."""
        self._master_stale = True

    # -- copies between the device and the host (Note [Optimizer copies]) -----------
    def _host(self, like: torch.Tensor, zero: bool) -> torch.Tensor:
        return self._runtime.host_empty(list(like.shape), "float32", zero)

    def _staged(self, t: torch.Tensor) -> bool:
        """True when ``t`` is on the runtime's device and moves through the copy engine."""
        return self._runtime.on_device(t)

    def _fetch(self, t: torch.Tensor) -> tuple:
        """Starts a copy of device tensor ``t`` into pinned memory: (host tensor, transfer, source).

        The host tensor has t's dtype and shape; wait on the transfer before
        reading it, and keep the source referenced until then.
        """
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()  # on the current stream, so the copy is ordered after it
        host = self._runtime.host_empty(list(src.shape), _DTYPE_NAMES[src.dtype], False)
        return host, self._runtime.copy_to_host(host, src), src

    def _read_into(self, dst: torch.Tensor, t: torch.Tensor) -> None:
        """dst (a host tensor) <- t, converting the dtype on the host."""
        if self._staged(t):
            host, transfer, _src = self._fetch(t)
            transfer.wait()
            dst.copy_(host.view(dst.shape))
        else:
            dst.copy_(t.detach())

    def _write_param(self, p: torch.Tensor, host: torch.Tensor) -> None:
        """p <- host (pinned, p's dtype): through the copy engine for a device parameter."""
        if self._staged(p) and p.is_contiguous():
            transfer = self._runtime.copy_to_device(p.detach(), host.view(p.shape))
            self._pending_uploads.append((transfer, host))
        else:
            p.detach().copy_(host.view(p.shape))

    def _finish_uploads(self) -> None:
        """Waits for every parameter upload; only then may their staging return to the pool."""
        uploads, self._pending_uploads = self._pending_uploads, []
        for transfer, _host in uploads:
            transfer.wait()

    # -- state -----------------------------------------------------------------

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        """A fresh state for p; when making it fails (a full tier) p keeps none, so a later step starts it again."""
        try:
            if self._nvme:
                master = p.detach().reshape(-1).to("cpu", torch.float32).contiguous()
                fresh = {"nvme_key": self._runtime.nvme_adam_add(master, bool(group["amsgrad"])),
                         "amsgrad": bool(group["amsgrad"])}
            else:
                fresh = {"exp_avg": self._host(p, True), "exp_avg_sq": self._host(p, True)}
                if group["amsgrad"]:
                    fresh["max_exp_avg_sq"] = self._host(p, True)
                master = self._host(p, False)
                self._read_into(master, p)
                fresh["master"] = master
        except BaseException:
            if p in self.state and len(self.state[p]) == 0:
                del self.state[p]
            raise
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state.update(fresh)
        if not self._nvme:
            self._register_state(p)
        return state

    def state_dict(self) -> dict:
        """torch's layout; ``master`` is included only for non-fp32 parameters
        (for fp32 ones the parameter itself is the master). States on NVMe are
        read back into CPU tensors, so checkpoints hold them too."""
        self.synchronize()
        sd = super().state_dict()
        if self._nvme:
            params = [p for g in self.param_groups for p in g["params"]]
            sd["state"] = {k: self._materialize_or_mark(params[k], self.state[params[k]]) for k in sd["state"]}
        params = [p for g in self.param_groups for p in g["params"]]
        index = {i: p for i, p in enumerate(params)}
        state = {}
        for k, s in sd["state"].items():
            p = index.get(k)
            if p is not None and p.dtype == torch.float32 and "master" in s:
                s = {n: v for n, v in s.items() if n != "master"}
            state[k] = s
        sd["state"] = state
        return sd

    @staticmethod
    def _master_from(saved: Optional[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        # A saved master is used only where it is consistent with the parameter:
        # a checkpoint that went through torch.optim may carry a stale one.
        if saved is None or p.dtype == torch.float32:
            return p.detach()
        if saved.shape == p.shape and torch.equal(saved.to(p.dtype), p.detach()):
            return saved
        return p.detach()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a CPUAdamW or torch Adam/AdamW state dict, keeping fp32 precision. Refuses one with
        states marked lost (Note [NVMe optimizer faults]), naming them."""
        lost = [k for k, s in state_dict.get("state", {}).items() if isinstance(s, dict) and LOST_STATE in s]
        if lost:
            params = [p for g in self.param_groups for p in g["params"]]
            names = ", ".join(self._describe(params[k]) if isinstance(k, int) and k < len(params) else repr(k)
                              for k in lost)
            raise _C.TierflowError(
                f"tierflow CPUAdamW.load_state_dict: the state of {len(lost)} parameter(s) was lost when this state "
                f"dict was saved ({names}; '{LOST_STATE}' marks them); take their states from an earlier "
                "checkpoint with tierflow.CPUAdamW.fill_lost_states(state_dict, earlier) and load that")
        if self._stream is not None:
            self._wait_worker()
            self._stream.restore_grads()  # the next step() still takes this backward's gradients
            self._stream.end_window()  # early steps read the state being replaced
            self._stream.synchronize()
        # torch casts state to the parameter's dtype; keep the fp32 originals.
        originals = {k: {n: v for n, v in s.items() if n in _STATE_KEYS}
                     for k, s in state_dict["state"].items()}
        groups, dicts = self.param_groups, list(self.param_groups)
        super().load_state_dict(state_dict)
        # torch puts fresh group dicts in a fresh list; keep the shared ones (Note [Shared param groups]).
        for shared, loaded in zip(dicts, self.param_groups):
            if shared is not loaded:
                shared.clear()
                shared.update(loaded)
        groups[:] = dicts
        self.param_groups = groups
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for p, key in zip(group["params"], saved["params"]):
                if p not in self.state or key not in originals:
                    continue
                state = self.state[p]
                for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if name in originals[key]:
                        fresh = self._host(p, False)
                        fresh.copy_(originals[key][name])
                        state[name] = fresh
                if group["amsgrad"] and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = self._host(p, True)
                master = self._host(p, False)
                master.copy_(self._master_from(originals[key].get("master"), p))
                state["master"] = master
                step = state.get("step", 0.0)
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
                if self._nvme:
                    self._reserve_nvme([(p, group)])
                    self._to_nvme(p, state, group)
                else:
                    self._register_state(p)
        self._master_stale = False

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

    @torch.no_grad()
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        count = self._grad_events.get(p, 0) + 1
        self._grad_events[p] = count
        if p in self._spec:
            self._take_back(p)  # its gradient changed again (accumulation went on)
        if count != self._accumulation or p.grad is None or self._steps_after_backward:
            return  # (under DDP: no steps during backward, Note [Distributed training])
        grad = p.grad
        if grad.is_sparse or grad.dtype not in _GRAD_DTYPES or not grad.is_contiguous() or not p.is_contiguous():
            return  # step() handles (and reports) these
        group = self._group_of(p)
        if group is None:
            return
        if self._gpu_share is None:
            self._gpu_share = self._assign_gpu_share()
        if id(p) in self._gpu_share:
            return  # steps on the GPU in step()
        options = self._options(group)
        state = self.state[p]
        if len(state) == 0:
            state = self._init_state(p, group)
        elif self._master_stale:
            self._read_into(state["master"], p)
        step = int(state["step"].item()) + 1
        vmax = state.get("max_exp_avg_sq") if options["amsgrad"] else None
        try:
            outs = [self._host(p, False) for _ in range(4 if options["amsgrad"] else 3)]
            # A device parameter is written back only when step() confirms: the
            # new value waits in pinned memory, and taking a step back needs no
            # restore. Its gradient is staged by the runtime (Note [Optimizer copies]).
            staging = (self._runtime.host_empty(list(p.shape), _DTYPE_NAMES[p.dtype], False)
                       if self._staged(p) else None)
            param_out = staging if staging is not None else p.detach()
            self._runtime.adam_step_async(options, step, [state["master"]], [state["exp_avg"]],
                                          [state["exp_avg_sq"]], [vmax], [grad], [param_out], [outs[0]], [outs[1]],
                                          [outs[2]], [outs[3] if options["amsgrad"] else None])
        except _C.OutOfMemoryError:
            self._overlap_counts["held"] += 1  # stepped in step() instead
            return
        self._spec[p] = {"grad": grad, "version": grad._version, "options": options, "outs": outs, "step": step,
                         "staging": staging}
        self._overlap_counts["early_steps"] += 1

    def _wait_worker(self) -> None:
        """Waits for queued early steps; if one failed, takes all of them back before raising."""
        try:
            self._runtime.adam_wait()
            if self._stream is not None:
                self._stream.wait_worker()
        except Exception:
            for p in list(self._spec):
                self._take_back(p, wait=False)
            if self._stream is not None:
                self._stream.discard_all()
            raise

    def _take_back(self, p: torch.Tensor, wait: bool = True) -> None:
        """Discards p's early step: the old state stays and p gets the old master back."""
        if wait:
            self._wait_worker()
            if p not in self._spec:
                return
        spec = self._spec.pop(p)
        if spec["staging"] is None:  # a CPU parameter was written early: restore it
            p.detach().copy_(self.state[p]["master"])
        self._overlap_counts["taken_back"] += 1

    def _take_back_all(self) -> None:
        for p in list(self._spec):
            self._take_back(p)

    def has_unconfirmed_steps(self) -> bool:
        """True while parameters hold early steps that no step() has confirmed."""
        return bool(self._spec) or (self._stream is not None and self._stream.has_unconfirmed())

    @torch.no_grad()
    def take_back_unconfirmed(self) -> None:
        """Restores every parameter stepped early but not confirmed (wrap() calls this before a forward)."""
        self._take_back_all()
        if self._stream is not None:
            self._stream.discard_all()

    def _clip_coefficient(self) -> tuple[float, bool]:
        """(clip coefficient, all gradients finite), with clip_grad_norm_'s own ops."""
        if self._max_grad_norm is None and not self._skip_nonfinite:
            return 1.0, True
        released = self._stream.released_norms() if self._offload_grads else {}
        if released:
            total = self._total_norm_with_released(released)
        else:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if not grads:
                return 1.0, True
            total = torch.nn.utils.get_total_norm(grads, 2.0)
        finite = bool(torch.isfinite(total))
        if self._max_grad_norm is None:
            return 1.0, finite
        coef = torch.clamp(self._max_grad_norm / (total + 1e-6), max=1.0)
        return float(coef), finite

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; also takes back early steps that no step() confirmed."""
        if self._spec:
            self._take_back_all()
        if self._stream is not None:
            self._stream.end_window()
        self._grad_events.clear()
        self._nvme_done.clear()  # a new window: the next step() is a step for everyone
        super().zero_grad(set_to_none=set_to_none)

    # -- step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adam/AdamW step over every parameter that has a gradient."""
        if self._offload_grads and hasattr(self, "found_inf"):
            # torch.amp.GradScaler (see _step_supports_amp_scaling) unscaled and checked only the
            # gradients still in p.grad: the released ones would step scaled and unchecked.
            for attr in ("found_inf", "grad_scale"):  # the scaler deletes them only after a step
                self.__dict__.pop(attr, None)
            raise _C.TierflowError(
                "tierflow CPUAdamW: torch.amp.GradScaler cannot see gradients that TIERFLOW_OFFLOAD_GRADIENTS=on "
                "has freed on the device; accepted: bf16 without a scaler (with TIERFLOW_SKIP_NONFINITE=on "
                "for inf/NaN steps), or TIERFLOW_OFFLOAD_GRADIENTS=off with the scaler")
        self._mark_step_called()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_worker()
        scale, finite = self._clip_coefficient()
        # Note [Distributed training]: early steps all redone in a multi-process run (an all-reduce) turn them off.
        watch = self._overlap and not self._master_stale and not self._steps_after_backward
        watched = self.overlap_stats if watch else None
        if self._skip_nonfinite and not finite:
            self._take_back_all()
            if self._stream is not None:
                self._stream.restore_grads()  # a skipped step leaves p.grad as torch's does
                self._stream.end_window()
            self._overlap_counts["skipped_steps"] += 1
        elif self._stream is not None:
            # Note [Gradient streaming]: the stream commits or redoes what it carried and
            # sends the weights back; the Python path steps only what it left.
            self._push_groups()
            unhandled = self._stream.finish(scale, self._master_stale)
            for group, params in zip(self.param_groups, self._python_path(unhandled)):
                if params:
                    self._step_group(group, scale, params)
            self._size_buckets()
            self._choose_gpu_share()
        else:
            problems: list = []
            for group in self.param_groups:
                problems += self._step_group(group, scale) or []
            if problems:  # Note [NVMe optimizer faults]: the others stepped; a retry steps these
                self._finish_uploads()
                self._master_stale = False
                raise self._nvme_step_error(problems)
            self._nvme_done.clear()
        if watched is not None:
            from .._distributed import note_step

            note_step(self, watched, scale)
        self._finish_uploads()
        self._grad_events.clear()
        self._master_stale = False
        return loss

    def _confirm(self, p: torch.Tensor, options: dict, scale: float) -> bool:
        """Commits p's early step if it is exactly the step that step() would take."""
        spec = self._spec.get(p)
        if spec is None:
            return False
        same = (spec["grad"] is p.grad and spec["version"] == p.grad._version and spec["options"] == options
                and scale == 1.0 and not self._master_stale)
        if not same:
            self._take_back(p)
            self._overlap_counts["redone"] += 1
            return False
        self._spec.pop(p)
        state = self.state[p]
        outs = spec["outs"]
        state["master"], state["exp_avg"], state["exp_avg_sq"] = outs[0], outs[1], outs[2]
        if options["amsgrad"]:
            state["max_exp_avg_sq"] = outs[3]
        state["step"] += 1
        if spec["staging"] is not None:
            self._write_param(p, spec["staging"])
        self._overlap_counts["committed"] += 1
        return True

    def _step_group_nvme(self, group: dict, options: dict) -> list:
        """States on NVMe: one pipelined pass per step number (Note [Optimizer states on NVMe]).

        Returns the parameters it could not step, [(param, lost?, reason)] (Note [NVMe optimizer faults]);
        every other parameter with a gradient stepped, exactly once per gradient."""
        buckets: dict[int, list] = {}
        problems: list = []
        todo = [p for p in group["params"]
                if p.grad is not None and id(p) not in self._gpu_share and not self._stepped_already(p)]
        # A group added after the optimizer was made reserves its space at its first step.
        fresh = [(p, group) for p in todo if id(p) not in self._reserved and len(self.state.get(p, {})) == 0]
        if fresh:
            try:
                self._reserve_nvme(fresh)
            except (_C.IOError, _C.OutOfMemoryError) as e:
                problems += [(p, False, str(e)) for p, _ in fresh]
                unreserved = {id(p) for p, _ in fresh}
                todo = [p for p in todo if id(p) not in unreserved]
        for p in todo:
            grad = p.grad.detach()
            _check_grad(grad)
            state = self.state[p]
            if len(state) == 0:
                try:
                    state = self._init_state(p, group)
                except (_C.IOError, _C.OutOfMemoryError) as e:
                    problems.append((p, False, str(e)))  # no state made: the next step() starts it again
                    continue
            elif self._master_stale:
                full = self._materialize(p, state)
                self._read_into(full["master"], p)
                state.update({k: v for k, v in full.items() if k != "step"})
                self._to_nvme(p, state, group)
            if self._staged(grad):
                host_grad, transfer, _src = self._fetch(grad)
                transfer.wait()
                grad = host_grad.reshape(-1)
            else:
                grad = grad.reshape(-1)
                if grad.device.type != "cpu" or not grad.is_contiguous():
                    grad = grad.to("cpu").contiguous()
            if p.device.type == "cpu" and p.is_contiguous() and not self._staged(p):
                out, copy = p.detach().reshape(-1), False
            else:
                out, copy = self._runtime.host_empty([p.numel()], _DTYPE_NAMES[p.dtype], False), True
            b = buckets.setdefault(int(state["step"].item()) + 1, [[], [], [], []])
            b[0].append(state["nvme_key"])
            b[1].append(grad)
            b[2].append(out)
            b[3].append((p, state, copy))
        for step, (keys, grads, outs, members) in buckets.items():
            failed, first_error, lost = self._runtime.nvme_adam_step(options, step, keys, grads, outs)
            failed, lost = set(failed), set(lost)
            for i, (p, state, copy) in enumerate(members):
                if i in failed:  # kept its previous state and weight (or lost its state): nothing to copy
                    problems.append((p, i in lost, first_error))
                    continue
                state["step"] += 1
                self._nvme_done[p] = (p.grad, p.grad._version, float(state["step"]))
                if copy:
                    self._write_param(p, outs[i].view(p.shape))
        return problems

    def _step_group(self, group: dict, scale: float = 1.0, params: Optional[list] = None) -> Optional[list]:
        options = self._options(group)
        if self._gpu_share is None:
            self._gpu_share = self._assign_gpu_share()
        if self._nvme:
            return self._step_group_nvme(group, dict(options, grad_scale=scale) if scale != 1.0 else options)
        buckets: dict[int, list] = {}
        copy_back: list = []
        on_gpu: list = []
        fetches: list = []
        for p in group["params"] if params is None else params:
            if p.grad is not None and id(p) in self._gpu_share:
                on_gpu.append(p)
                continue
            if p.grad is None:
                if p in self._spec:
                    self._take_back(p)
                continue
            if self._confirm(p, options, scale):
                continue
            grad = p.grad
            _check_grad(grad)
            state = self.state[p]
            if len(state) == 0:
                state = self._init_state(p, group)
            elif self._master_stale:
                self._read_into(state["master"], p)
            state["step"] += 1
            if self._staged(grad):
                host_grad, transfer, src = self._fetch(grad)
                fetches.append((transfer, src))  # all gradients in flight at once; waited below
            else:
                host_grad = grad.detach()
                if host_grad.device.type != "cpu" or not host_grad.is_contiguous():
                    host_grad = host_grad.to("cpu").contiguous()
            if p.device.type == "cpu" and p.is_contiguous() and not self._staged(p):
                out = p.detach()
            else:
                out = self._runtime.host_empty(list(p.shape), _DTYPE_NAMES[p.dtype], False)
                copy_back.append((p, out))
            b = buckets.setdefault(int(state["step"].item()), [[], [], [], [], [], []])
            b[0].append(state["master"])
            b[1].append(state["exp_avg"])
            b[2].append(state["exp_avg_sq"])
            b[3].append(state.get("max_exp_avg_sq") if options["amsgrad"] else None)
            b[4].append(host_grad)
            b[5].append(out)
        if scale != 1.0:
            options = dict(options, grad_scale=scale)
        if on_gpu:
            self._step_on_gpu(on_gpu, options)
        for transfer, _src in fetches:
            transfer.wait()
        for step, (masters, ms, vs, vmaxes, grads, outs) in buckets.items():
            self._runtime.adam_step(options, step, masters, ms, vs, vmaxes, grads, outs)
        for p, out in copy_back:
            self._write_param(p, out)
