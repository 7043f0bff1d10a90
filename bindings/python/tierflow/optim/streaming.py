"""CPUAdamW's side of the C++ gradient stream (Note [Gradient streaming] in
bindings/include/tierflow/bindings/grad_stream.hpp): the callbacks the stream
makes, the weights' waits in the next forward, the global norm over offloaded
gradients, and the measured bucket size. A mixin of tierflow.optim.CPUAdamW,
whose state (_stream, _slot_of, _slot_params, ...) it reads; kept apart so
that optim.py holds the optimizer's own step and state."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .._compile import outside_graphs


class StreamingMixin:
    """The gradient-stream methods of CPUAdamW (see the module doc)."""

    def _attach_weight_waits(self, model: torch.nn.Module) -> None:
        """TIERFLOW_WEIGHTS_RETURN=forward: each module's forward waits (one C++ call) only
        for its own parameters' new weights; the model's state_dict and load_state_dict
        wait for all of them (Note [Gradient streaming]).

        A container without a forward of its own (ParameterList, ParameterDict, ModuleList,
        ModuleDict) is never called: its parameters are read by the forward of the module
        holding it, whose pre-hook therefore waits for them too. A weight read by a forward
        other than its module's without that module being called first (F.linear(x,
        self.proj.weight) with self.proj never called) is not waited for: keep the default
        TIERFLOW_WEIGHTS_RETURN=step for such models."""
        me = weakref.ref(self)

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
                opt = me()
                if opt is not None and opt._stream is not None:
                    opt._stream.wait_module(module_id)
            return pre_hook

        for module in model.modules():
            if not has_forward(module):
                continue
            slots = [self._slot_of[p] for p in read_by_forward(module) if p in self._slot_of]
            if slots:
                self._hooks.append(module.register_forward_pre_hook(  # Note [Hooks outside graphs]
                    outside_graphs(waiter(self._stream.add_module(slots)))))

        def synchronize(*_args: Any) -> None:
            opt = me()
            if opt is not None:
                opt.synchronize()

        self._hooks.append(model.register_state_dict_pre_hook(synchronize))
        self._hooks.append(model.register_load_state_dict_pre_hook(synchronize))

    def _attach_step_wait(self, model: torch.nn.Module) -> None:
        """TIERFLOW_WEIGHTS_RETURN=step: step() made the stream current then wait for the new weights; the
        model's forward on any other stream (under torch.cuda.stream(s)) waits for them too, one C++ call that
        returns at once when the copies are complete or the stream already waits (Note [Gradient streaming])."""
        me = weakref.ref(self)

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            opt = me()
            if opt is not None and opt._stream is not None:
                opt._stream.wait_step_uploads()

        self._hooks.append(model.register_forward_pre_hook(outside_graphs(pre_hook)))  # Note [Hooks outside graphs]

    def stream_stats(self) -> dict:
        """The gradient stream's counters and times (Note [Gradient streaming]); empty when it is off."""
        out = dict(self._stream.stats()) if self._stream is not None else {}
        if out:
            out["gpu_optimizer_fraction"] = self._gpu_fraction
        return out

    def synchronize(self) -> None:
        """Waits until every updated weight is back on the device (TIERFLOW_WEIGHTS_RETURN=forward).

        Forwards of the wrapped model, its state_dict and load_state_dict, and
        this optimizer's state_dict and step wait by themselves; call this before
        reading parameters any other way between step() and the next forward.
        """
        if self._stream is not None:
            self._stream.synchronize()

    def _push_groups(self) -> None:
        for gi, group in enumerate(self.param_groups):
            self._stream.set_group(gi, self._options(group))

    def _on_backward_begin(self) -> None:
        """Once per backward, from C++: the hyperparameters in force (an LR scheduler may have changed them)."""
        self._push_groups()
        # Under DDP every parameter steps in step(), from the reduced gradient (Note [Distributed training]).
        self._stream.set_enabled(not self._master_stale and not self._steps_after_backward)

    @torch.no_grad()
    def _init_slot(self, slot: int) -> None:
        """From C++, the first time a parameter streams: its state (first step only)."""
        p = self._slot_params[slot]
        state = self.state[p]
        if len(state) == 0:
            self._init_state(p, self._group_of(p))
        else:
            self._register_state(p)

    def _register_state(self, p: torch.Tensor) -> None:
        """Gives the C++ stream p's state tensors (after they were created or replaced)."""
        slot = self._slot_of.get(p) if self._stream is not None else None
        if slot is not None and "master" in self.state[p]:
            self._stream.set_state(slot, self.state[p])

    def _python_path(self, unhandled: list) -> list:
        """Per group, the parameters step() steps in Python: those the stream does not
        carry (computed once) and the slots it left (`unhandled`, usually none)."""
        if self._python_params is None:
            self._python_params = [[p for p in g["params"] if p not in self._slot_of] for g in self.param_groups]
        if not unhandled:
            return self._python_params
        extra = {id(self._slot_params[i]) for i in unhandled}
        return [[p for p in g["params"] if id(p) in extra] + base
                for g, base in zip(self.param_groups, self._python_params)]

    def _total_norm_with_released(self, released: dict) -> torch.Tensor:
        """torch.nn.utils.get_total_norm over every gradient, where a released one (on the host
        only) enters as the per-tensor norm the C++ hook computed with the same op
        (_foreach_norm) before freeing it: same grouping by device and dtype, same order."""
        items = []  # a gradient, or the norm standing for a released one (same device and dtype)
        is_norm = []
        for g in self.param_groups:
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

    def _size_buckets(self) -> None:
        """TIERFLOW_GRAD_BUCKET_BYTES=auto, after the second step whose gradients streamed (the
        first also created the optimizer states): the bucket size from that backward, CPU
        AdamW rate and the device -> host link (optimizer::measured_grad_bucket_bytes: the
        last bucket's copy and step, which run after backward, within 2% of it)."""
        if not self._buckets_unsized or not self._slot_params:
            return
        s = self._stream.stats()
        if s["last_backward_ms"] <= 0 or s["kernel_grad_bytes"] <= 0:
            return  # nothing streamed and stepped yet: measure at a later step
        self._streamed_steps += 1
        if self._streamed_steps < 2:
            return
        self._buckets_unsized = False
        from .._links import measure_links

        total = sum(p.numel() * p.element_size() for p in self._slot_params)
        probe = max(1 << 20, min(16 << 20, total // 16))  # a bucket-sized copy, at most 16 MiB of device memory
        link = measure_links(self._runtime, self._slot_params[0].device, probe)["d2h"]
        self._stream.size_buckets(link)
