"""CPUAdamW's GPU share (Deep Optimizer States): which CUDA parameters step on
the GPU, chosen from measured speeds with TIERFLOW_GPU_OPTIMIZER_FRACTION=auto,
and their step with tierflow's CUDA AdamW. A mixin of tierflow.optim.CPUAdamW,
whose state (_gpu_fraction, _gpu_share, _stream, ...) it reads."""

from __future__ import annotations

import torch

from .. import _C


class GpuShareMixin:
    """The GPU-share methods of CPUAdamW (see the module doc)."""

    def _choose_gpu_share(self) -> None:
        """TIERFLOW_GPU_OPTIMIZER_FRACTION=auto, after the first streamed step: the share of CUDA
        parameters that steps on the GPU so that the CPU's step ends with backward, from the
        measured CPU rate and backward time, within the device memory left (Deep Optimizer States)."""
        if not self._gpu_fraction_auto:
            return
        self._gpu_fraction_auto = False  # decided once
        cuda = [p for g in self.param_groups for p in g["params"] if p.device.type == "cuda" and p in self._slot_of]
        opt = self._runtime.stats()["optimizer"]
        backward_ms = self._stream.stats()["last_backward_ms"]
        if not cuda or opt["step_ms"] <= 0 or backward_ms <= 0:
            self._gpu_share = set()
            return
        rate = opt["elements"] / (opt["step_ms"] / 1e3)
        dev = cuda[0].device
        free, _total = torch.cuda.mem_get_info(dev)
        room = gpu_share_room(free, int(self._runtime.device_budget_bytes()), torch.cuda.max_memory_allocated(dev))
        # m and v in fp32, plus an fp32 master for 16-bit parameters.
        per_element = 12 if any(p.dtype != torch.float32 for p in cuda) else 8
        self._gpu_fraction = _C.choose_gpu_fraction(rate, 0.0, backward_ms / 1e3, sum(p.numel() for p in cuda),
                                                    per_element, room)
        self._gpu_share = self._assign_gpu_share()
        for p in cuda:
            if id(p) not in self._gpu_share:
                continue
            self._stream.exclude(self._slot_of.pop(p))
            state = self.state.get(p)
            if state and "master" in state:  # its CPU state moves to the device
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if k in state:
                        state[k] = state[k].to(p.device).view_as(p)
                state["master"] = p.detach() if p.dtype == torch.float32 else state["master"].to(p.device).view_as(p)
        self._python_params = None

    def _assign_gpu_share(self) -> set:
        """Deep Optimizer States: interleave CUDA params so about `fraction` of the elements step on the GPU."""
        chosen: set = set()
        if self._gpu_fraction <= 0:
            return chosen
        gpu, seen = 0, 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type != "cuda":
                    continue
                seen += p.numel()
                if gpu + p.numel() / 2 <= self._gpu_fraction * seen:
                    chosen.add(id(p))
                    gpu += p.numel()
        return chosen

    def _step_on_gpu(self, params: list, options: dict) -> None:
        buckets: dict[int, list] = {}
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if options["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["master"] = p.detach() if p.dtype == torch.float32 else p.detach().float()
            state["step"] += 1
            b = buckets.setdefault(int(state["step"].item()), [[], [], [], [], [], []])
            b[0].append(state["master"])
            b[1].append(state["exp_avg"])
            b[2].append(state["exp_avg_sq"])
            b[3].append(state.get("max_exp_avg_sq") if options["amsgrad"] else None)
            b[4].append(p.grad.contiguous())
            b[5].append(None if p.dtype == torch.float32 else p.detach())
        for step, (masters, ms, vs, vmaxes, grads, outs) in buckets.items():
            _C.cuda_adam_step(options, step, masters, ms, vs, vmaxes, grads, outs)


def gpu_share_room(free_bytes: int, budget_bytes: int, first_step_peak_bytes: int) -> int:
    """Device bytes the GPU share's states may take: within TIERFLOW_GPU_MEMORY, what the first step's peak left
    of it (that step ran the activation planner's floor, so every plan the planner can make still fits: the
    timing step's measured peak, which the plan is made from, then holds the share's states as fixed bytes), and
    at most half of what the device has free."""
    return max(0, min(free_bytes // 2, budget_bytes - first_step_peak_bytes))
