"""CPUAdamW's GPU share (Deep Optimizer States): which CUDA parameters step on
the GPU, chosen from measured speeds with TIERFLOW_GPU_OPTIMIZER_FRACTION=auto,
and their step with tierflow's CUDA AdamW. CPUAdamW owns one GpuShare and hands
it its param groups, its state and its gradient stream where a call needs them."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _C


class GpuShare:
    """The CUDA parameters that step on the GPU (see the module doc)."""

    def __init__(self, setting: str) -> None:
        self.auto = setting == "auto"  # chosen after the first step (choose)
        self.fraction = 0.0 if self.auto else float(setting)
        self.ids: Optional[set] = None  # ids of CUDA params stepped on the GPU, fixed at the first step

    def ensure(self, param_groups: list) -> set:
        """The share, assigned from the fraction the first time it is needed."""
        if self.ids is None:
            self.ids = self.assign(param_groups)
        return self.ids

    def assign(self, param_groups: list) -> set:
        """Deep Optimizer States: interleave CUDA params so about `fraction` of the elements step on the GPU."""
        chosen: set = set()
        if self.fraction <= 0:
            return chosen
        gpu, seen = 0, 0
        for group in param_groups:
            for p in group["params"]:
                if p.device.type != "cuda":
                    continue
                seen += p.numel()
                if gpu + p.numel() / 2 <= self.fraction * seen:
                    chosen.add(id(p))
                    gpu += p.numel()
        return chosen

    def choose(self, param_groups: list, runtime: "_C.Runtime", streaming: Any, state: Any) -> None:
        """TIERFLOW_GPU_OPTIMIZER_FRACTION=auto, after the first streamed step: the share of CUDA
        parameters that steps on the GPU so that the CPU's step ends with backward, from the
        measured CPU rate and backward time, within the device memory left (Deep Optimizer States).
        ``streaming``: the optimizer's GradientStreaming (the chosen leave it); ``state``: its state."""
        if not self.auto:
            return
        self.auto = False  # decided once
        cuda = [p for g in param_groups for p in g["params"] if p.device.type == "cuda" and streaming.carries(p)]
        opt = runtime.stats()["optimizer"]
        backward_ms = streaming.stream.stats()["last_backward_ms"]
        if not cuda or opt["step_ms"] <= 0 or backward_ms <= 0:
            self.ids = set()
            return
        rate = opt["elements"] / (opt["step_ms"] / 1e3)
        dev = cuda[0].device
        free, _total = torch.cuda.mem_get_info(dev)
        room = gpu_share_room(free, int(runtime.device_budget_bytes()), torch.cuda.max_memory_allocated(dev))
        # m and v in fp32, plus an fp32 master for 16-bit parameters.
        per_element = 12 if any(p.dtype != torch.float32 for p in cuda) else 8
        self.fraction = _C.choose_gpu_fraction(rate, 0.0, backward_ms / 1e3, sum(p.numel() for p in cuda),
                                               per_element, room)
        self.ids = self.assign(param_groups)
        for p in cuda:
            if id(p) not in self.ids:
                continue
            streaming.exclude(p)
            s = state.get(p)
            if s and "master" in s:  # its CPU state moves to the device
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if k in s:
                        s[k] = s[k].to(p.device).view_as(p)
                s["master"] = p.detach() if p.dtype == torch.float32 else s["master"].to(p.device).view_as(p)
        streaming.forget_python_path()

    @staticmethod
    def step(params: list, state: Any, options: dict) -> None:
        """One AdamW step of these parameters on the GPU, their states made there at their first step."""
        buckets: dict[int, list] = {}
        for p in params:
            s = state[p]
            if len(s) == 0:
                s["step"] = torch.tensor(0.0, dtype=torch.float32)
                s["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                s["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if options["amsgrad"]:
                    s["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                s["master"] = p.detach() if p.dtype == torch.float32 else p.detach().float()
            s["step"] += 1
            b = buckets.setdefault(int(s["step"].item()), [[], [], [], [], [], []])
            b[0].append(s["master"])
            b[1].append(s["exp_avg"])
            b[2].append(s["exp_avg_sq"])
            b[3].append(s.get("max_exp_avg_sq") if options["amsgrad"] else None)
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
