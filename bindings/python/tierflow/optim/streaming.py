"""CPUAdamW's side of the C++ gradient stream (Note [Gradient streaming] in
bindings/include/tierflow/bindings/grad_stream.hpp): which parameters it carries
(their slots), the weights' waits in the next forward, the global norm over
offloaded gradients, and the measured bucket size. CPUAdamW owns one
GradientStreaming and hands it what it needs (its param groups, each
parameter's state); the callbacks the stream makes stay in the optimizer."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from .. import _C
from .._compile import outside_graphs
from .._links import measure_links, probe_bytes


class GradientStreaming:
    """One C++ GradStream and the parameters it carries (see the module doc)."""

    def __init__(self, runtime: "_C.Runtime", accumulation: int, max_grad_norm: Optional[float],
                 skip_nonfinite: bool, offload_grads: bool) -> None:
        settings = runtime.settings()  # typed (Note [Typed settings])
        #: The C++ stream (its methods are called directly: finish, end_window, wait_worker, ...).
        self.stream = _C.GradStream(runtime, settings.grad_bucket_bytes or 0, accumulation,
                                    max_grad_norm or 0.0, skip_nonfinite,
                                    settings.weights_return_in_forward, offload_grads)
        self._runtime = runtime
        self._slot_of: dict = {}            # param -> slot of the C++ stream
        self._slot_params: list = []        # slot -> param
        self._shards: dict = {}             # FSDP2: id(param) -> the local tensor its slot steps
        self.fsdp_feed: Any = None          # FSDP2: tierflow._fsdp_feed's feed, which the user's clip asks too
        self._python_params: Optional[list] = None  # per group: params that step() handles in Python
        # TIERFLOW_GRAD_BUCKET_BYTES=auto: when it is sized (optimizer/grad_buckets.hpp).
        self._sizing = _C.BucketSizingSchedule(settings.grad_bucket_bytes is None)
        self._window = _C.WindowWatch(self._pinned_slabs())  # what each step()'s window showed (Note [Steady step])

    # -- the parameters it carries -------------------------------------------------
    def add_parameter(self, p: torch.Tensor, group_index: int) -> None:
        self._slot_of[p] = self.stream.add_parameter(p, group_index)
        self._slot_params.append(p)

    def add_fed_parameter(self, p: torch.Tensor, shard: torch.Tensor, group_index: int) -> None:
        """FSDP2: p is a DTensor parameter, ``shard`` its local tensor; its reduce-scattered gradients are fed
        (tierflow._fsdp_feed), never hooked."""
        slot = self.stream.add_fed_parameter(shard, p, group_index)
        self._slot_of[p] = slot
        self._slot_params.append(p)
        self._shards[id(p)] = shard
        self.stream.set_reduced([slot])

    def shard_of(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """FSDP2: the local tensor the stream steps for p (add_fed_parameter), or None."""
        return self._shards.get(id(p)) if p in self._slot_of else None

    def use_homes(self, offload: Any) -> None:
        """Committed weights of parameters kept on the host go into their host copies; parameters on NVMe step
        in step() (the Python path writes them there): Note [Parameter hooks]."""
        for p, slot in list(self._slot_of.items()):
            home = offload.host_copy(p)
            if home is not None:
                self.stream.set_home(slot, home)
            elif offload.offloaded(p):
                self.exclude(p)
        self.forget_python_path()

    def drop_homes(self, params: list) -> None:
        """These parameters are resident again: their committed weights go to the device."""
        for p in params:
            if p in self._slot_of:
                self.stream.set_home(self._slot_of[p], None)

    def carries(self, p: torch.Tensor) -> bool:
        return p in self._slot_of

    def stream_reduced(self, params: list) -> int:
        """DDP (Note [Distributed training]): the carried ones of ``params`` stream their reduced gradients
        (fed by tierflow._ddp_feed), not their local ones. Returns how many."""
        slots = [self._slot_of[p] for p in params if p in self._slot_of]
        self.stream.set_reduced(slots)
        return len(slots)

    def param_of(self, slot: int) -> torch.Tensor:
        return self._slot_params[slot]

    def exclude(self, p: torch.Tensor) -> None:
        """p steps elsewhere from now on (the GPU share): the stream no longer carries it."""
        self.stream.exclude(self._slot_of.pop(p))

    def set_state(self, p: torch.Tensor, state: dict) -> None:
        """Gives the C++ stream p's state tensors (after they were created or replaced)."""
        slot = self._slot_of.get(p)
        if slot is not None and "master" in state:
            self.stream.set_state(slot, state)

    def push_groups(self, options: list) -> None:
        """The hyperparameters in force, one options dict per param group."""
        for gi, group_options in enumerate(options):
            self.stream.set_group(gi, group_options)

    def forget_python_path(self) -> None:
        """The groups or the carried parameters changed: python_path computes its lists again."""
        self._python_params = None

    def python_path(self, param_groups: list, unhandled: list) -> list:
        """Per group, the parameters step() steps in Python: those the stream does not
        carry (computed once) and the slots it left (`unhandled`, usually none)."""
        if self._python_params is None:
            self._python_params = [[p for p in g["params"] if p not in self._slot_of] for g in param_groups]
        if not unhandled:
            return self._python_params
        extra = {id(self._slot_params[i]) for i in unhandled}
        return [[p for p in g["params"] if id(p) in extra] + base
                for g, base in zip(param_groups, self._python_params)]

    # -- the weights' way back (TIERFLOW_WEIGHTS_RETURN) ------------------------------
    def attach_weight_waits(self, model: torch.nn.Module) -> list:
        """TIERFLOW_WEIGHTS_RETURN=forward: each module's forward waits (one C++ call) only
        for its own parameters' new weights; the model's state_dict and load_state_dict
        wait for all of them (Note [Gradient streaming]). Returns the hook handles.

        A container without a forward of its own (ParameterList, ParameterDict, ModuleList,
        ModuleDict) is never called: its parameters are read by the forward of the module
        holding it, whose pre-hook therefore waits for them too. A weight read by a forward
        other than its module's without that module being called first (F.linear(x,
        self.proj.weight) with self.proj never called) is not waited for: keep the default
        TIERFLOW_WEIGHTS_RETURN=step for such models."""
        me = weakref.ref(self)
        hooks = []

        def has_forward(module: torch.nn.Module) -> bool:
            return type(module).forward is not torch.nn.Module.forward

        def read_by_forward(module: torch.nn.Module) -> list:
            params = list(module.parameters(recurse=False))
            for child in module.children():
                if not has_forward(child):
                    params += read_by_forward(child)
            return params

        def waiter(module_id: int) -> Callable:
            def pre_hook(module: torch.nn.Module, args: Any) -> None:
                streaming = me()
                if streaming is not None:
                    streaming.stream.wait_module(module_id)
            return pre_hook

        for module in model.modules():
            if not has_forward(module):
                continue
            slots = [self._slot_of[p] for p in read_by_forward(module) if p in self._slot_of]
            if slots:
                hooks.append(module.register_forward_pre_hook(  # Note [Hooks outside graphs]
                    outside_graphs(waiter(self.stream.add_module(slots)))))

        def synchronize(*_args: Any) -> None:
            streaming = me()
            if streaming is not None:
                streaming.stream.synchronize()

        hooks.append(model.register_state_dict_pre_hook(synchronize))
        hooks.append(model.register_load_state_dict_pre_hook(synchronize))
        return hooks

    def attach_step_wait(self, model: torch.nn.Module) -> list:
        """TIERFLOW_WEIGHTS_RETURN=step: step() made the stream current then wait for the new weights; the
        model's forward on any other stream (under torch.cuda.stream(s)) waits for them too, one C++ call that
        returns at once when the copies are complete or the stream already waits (Note [Gradient streaming]).
        Returns the hook handles."""
        me = weakref.ref(self)

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            streaming = me()
            if streaming is not None:
                streaming.stream.wait_step_uploads()

        return [model.register_forward_pre_hook(outside_graphs(pre_hook))]  # Note [Hooks outside graphs]

    # -- the global norm and the bucket size ------------------------------------------
    def total_norm_with_released(self, param_groups: list, released: dict) -> torch.Tensor:
        """torch.nn.utils.get_total_norm over every gradient, where a released one (on the host
        only) enters as the per-tensor norm the C++ hook computed with the same op
        (_foreach_norm) before freeing it: same grouping by device and dtype, same order."""
        items = []  # a gradient, or the norm standing for a released one (same device and dtype)
        is_norm = []
        for g in param_groups:
            for p in g["params"]:
                slot = self._slot_of.get(p)
                if p.grad is not None:
                    items.append(p.grad)
                    is_norm.append(False)
                elif slot is not None and slot in released:
                    items.append(released[slot])
                    is_norm.append(True)
        first_device = items[0].device
        grouped = torch.utils._foreach_utils._group_tensors_by_device_and_dtype([items], with_indices=True)
        norms = []
        for ([tensors], indices) in grouped.values():
            real = [t for t, i in zip(tensors, indices) if not is_norm[i]]
            computed = iter(torch._foreach_norm(real, 2.0) if real else [])
            norms.extend(t if is_norm[i] else next(computed) for t, i in zip(tensors, indices))
        return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), 2.0)

    def _pinned_slabs(self) -> int:
        return int(self._runtime.stats()["host_pool"]["slab_allocations"])

    @property
    def sizing_pending(self) -> bool:
        """TIERFLOW_GRAD_BUCKET_BYTES=auto has not sized the buckets yet."""
        return self._sizing.pending

    def window_seen(self) -> tuple:
        """What Note [Steady step] asks of the window step() ends, once per step(): whether its gradients
        streamed and the CPU AdamW stepped them, its backward (ms, first gradient to its end), and whether it
        allocated pinned slabs."""
        s = self.stream.stats()
        return self._window.seen(bool(self._slot_params), int(s["kernel_grad_bytes"]), self._pinned_slabs(),
                                 float(s["last_backward_ms"]))

    def size_buckets(self, seen: tuple) -> None:
        """TIERFLOW_GRAD_BUCKET_BYTES=auto, at the first steady step (Note [Steady step]: not the
        first streamed one, which also created the optimizer states, and none that grew the pinned
        pool): the bucket size from that backward, CPU AdamW rate and the device -> host link
        (optimizer::measured_grad_bucket_bytes: the last bucket's copy and step, which run after
        backward, within 2% of it). ``seen``: window_seen()'s."""
        if not self._sizing.pending:
            return
        streamed, backward_ms, grew = seen
        if not self._sizing.due(bool(self._slot_params), streamed, backward_ms, grew):
            return
        total = sum(p.numel() * p.element_size() for p in self._slot_params)
        self.stream.size_buckets(self._measure_link(total))

    def _measure_link(self, total_grad_bytes: int) -> float:
        """The device -> host rate for the bucket size, or 0.0 (a missing speed: measured_grad_bucket_bytes
        falls back to the first step's size) when the probe cannot run. It runs after step() committed (Note
        [Atomic step] in optimizer/step_plan.hpp), so it must not fail that step: its buffers are at most what the
        pinned pool has room for (probe_bytes: a sixteenth of it), and a probe that still fails is said and
        skipped."""
        probe = min(_C.grad_link_probe_bytes(total_grad_bytes), probe_bytes(self._runtime)) // 4096 * 4096
        if probe <= 0:
            _C.log("info", "tierflow gradient buckets: no pinned room left to measure the link; the buckets keep "
                           "the first step's size (raise TIERFLOW_HOST_MEMORY to have them measured)")
            return 0.0
        try:
            return float(measure_links(self._runtime, self._slot_params[0].device, probe)["d2h"])
        except Exception as e:  # noqa: BLE001  a speed, never worth a step: any failure leaves it unmeasured
            _C.log("warn", f"tierflow gradient buckets: the link probe failed ({e}); the buckets keep the first "
                           "step's size")
            return 0.0
