"""CPUAdamW's GPU share (Deep Optimizer States): which CUDA parameters step on
the GPU, chosen from measured speeds with TIERFLOW_GPU_OPTIMIZER_FRACTION=auto,
and their step with tierflow's CUDA AdamW. CPUAdamW owns one GpuShare and hands
it its param groups, its state and its gradient stream where a call needs them.

The share's states stay fp32 on the device whatever TIERFLOW_OPTIMIZER_STATES says (Note [Optimizer state
formats]): the share is a few percent of the parameters, so packing its moments would save little; its CUDA
kernel is bit for bit torch's fused AdamW in fp32 (optimizer/cuda_adam.hpp), which packed moments would give
up; and the planner budgeted its device memory at 8 bytes of moments an element (gpu_share_bytes_per_element).
A parameter that moves from the host into the share (choose) has its host moments decoded to fp32 on the way
(_device_copies); nothing moves a parameter from the share back to the host. One info line says so when the
format is not fp32."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _C


#: The activation plan as the share's choice sees it, a value read when the choice is asked, never a reference into
#: the planner (optimizer/step_plan.hpp): ``in_force`` (while the planner profiles, no plan is, and the share waits)
#: and ``predicted_peak_bytes`` (0: none), whose rest of the budget the share may take (gpu_share_room).
PlanRoom = _C.PlanRoom
NO_PLAN = PlanRoom()  # no activation planner: nothing to wait for, no predicted peak


def plan_room(planner: Any) -> PlanRoom:
    """The room of ``planner``'s plan (an AutoPlanner: its ``forced`` and ``plan``), or NO_PLAN for None."""
    if planner is None:
        return NO_PLAN
    plan = planner.plan
    return _C.plan_room(bool(planner.forced), plan is not None,
                        int((plan or {}).get("predicted_device_peak_bytes") or 0))


class GpuShare:
    """The CUDA parameters that step on the GPU (see the module doc)."""

    def __init__(self, setting: str, state_format: str = "fp32") -> None:
        self.choice = _C.GpuShareChoice(setting)  # the decision: optimizer/grad_buckets.hpp
        self.ids: Optional[set] = None  # ids of CUDA params stepped on the GPU, fixed at the first step
        # Before issue 40, wrap set a weakref to its activation planner here; choose still reads it when it is
        # not handed the plan's room (``plan``), for a caller that sets it. CPUAdamW hands the room.
        self.planner: Optional[Any] = None
        self.took_bytes = 0  # device bytes the states of the parameters that moved in took (choose)
        self.state_format = state_format  # the host's moments (TIERFLOW_OPTIMIZER_STATES); the share keeps fp32
        self._format_noted = False

    def _note_format(self) -> None:
        """The one info line (module doc): a share with states while the host's moments are packed."""
        note = _C.gpu_share_format_note(len(self.ids or ()), self.state_format)
        if self.ids and note and not self._format_noted:
            self._format_noted = True
            _C.log("info", note)

    @property
    def auto(self) -> bool:
        """TIERFLOW_GPU_OPTIMIZER_FRACTION=auto has not chosen yet (it chooses after the first step)."""
        return self.choice.pending

    @property
    def fraction(self) -> float:
        return self.choice.fraction

    def ensure(self, param_groups: list) -> set:
        """The share, assigned from the fraction the first time it is needed."""
        if self.ids is None:
            cuda = [p for group in param_groups for p in group["params"] if p.device.type == "cuda"]
            self.ids = {id(p) for p, on_gpu in zip(cuda, self.choice.assign([p.numel() for p in cuda])) if on_gpu}
            self._note_format()
        return self.ids

    def choose(self, param_groups: list, runtime: "_C.Runtime", streaming: Any, state: Any, seen: tuple,
               plan: Optional[PlanRoom] = None) -> bool:
        """TIERFLOW_GPU_OPTIMIZER_FRACTION=auto, at the first steady step (Note [Steady step]; ``seen``:
        GradientStreaming.window_seen()'s): GpuShareChoice.choose decides from the numbers gathered here; the
        chosen leave ``streaming`` (the optimizer's GradientStreaming) and their CPU ``state`` moves to the
        device. Under the activation planner (auto), only once its plan is in force, in the room it leaves
        (``plan``, a value: PlanRoom); the caller then settles the plan when any moved (``took_bytes``).
        Returns whether any parameter moved."""
        if plan is None:
            plan = plan_room(self.planner() if self.planner is not None else None)
        if not self.choice.due(seen, plan):  # Note [Steady step], with the plan in force
            return False
        cuda = [p for g in param_groups for p in g["params"] if p.device.type == "cuda"]
        carried = [streaming.carries(p) for p in cuda]
        candidates = [(p.numel(), c, p.dtype != torch.float32) for p, c in zip(cuda, carried)]
        opt = runtime.stats()["optimizer"]
        on_gpu = self.choice.choose(candidates, opt["elements"], opt["step_ms"], seen[1],
                                    *_device_room(runtime, cuda, carried, plan))
        self.ids = {id(p) for p, g in zip(cuda, on_gpu) if g}
        if not self.ids:
            return False
        moved = [p for p, c in zip(cuda, carried) if c and id(p) in self.ids]
        # Note [Atomic step]: this runs after the step committed, so it may not fail it: every device copy is
        # made before any state changes, and a device without the room keeps the share on the CPU.
        try:
            copies = [_device_copies(p, state.get(p)) for p in moved]
        except (torch.OutOfMemoryError, _C.OutOfMemoryError) as e:
            self.ids = set()
            _C.log("warn", "tierflow: the CPU optimizer's GPU share found no device memory for its states "
                           f"({str(e).splitlines()[0]}); every parameter steps on the CPU")
            return False
        self._note_format()
        for p, c in zip(moved, copies):
            streaming.exclude(p)
            if c:
                state[p].update(c)
        streaming.forget_python_path()
        self.took_bytes = _C.gpu_share_took_bytes(candidates, on_gpu)
        return True

    @staticmethod
    def step(params: list, state: Any, options: dict) -> None:
        """One AdamW step of these parameters on the GPU, their states made there at their first step."""
        # Note [Weight content]: a 16-bit parameter that is not its master's rounding was written by the user (an
        # fp32 one is its own master): its master is re-read from it, as torch's AdamW steps from p.
        held = [p for p in params if len(state[p]) and p.dtype != torch.float32]
        if held:
            written = torch.stack([(state[p]["master"].to(p.dtype) != p.detach()).any() for p in held]).tolist()
            for p, w in zip(held, written):
                if w:
                    state[p]["master"].copy_(p.detach())
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
        for step, batch in _C.group_by_step([int(state[p]["step"].item()) for p in params]):
            batch = [(p, state[p]) for p in (params[i] for i in batch)]
            _C.cuda_adam_step(options, step, [s["master"] for _, s in batch], [s["exp_avg"] for _, s in batch],
                              [s["exp_avg_sq"] for _, s in batch],
                              [s.get("max_exp_avg_sq") if options["amsgrad"] else None for _, s in batch],
                              [p.grad.contiguous() for p, _ in batch],
                              [None if p.dtype == torch.float32 else p.detach() for p, _ in batch])


def _device_room(runtime: "_C.Runtime", cuda: list, carried: list, plan: PlanRoom) -> tuple:
    """(free, budget, peak so far, the activation plan's predicted peak or 0) of the device the share's candidates
    live on (gpu_share_room weighs them); zeros without a candidate."""
    if not any(carried):
        return (0, 0, 0, 0)
    dev = next(p for p, c in zip(cuda, carried) if c).device
    return (torch.cuda.mem_get_info(dev)[0], int(runtime.device_budget_bytes()),
            torch.cuda.max_memory_allocated(dev), plan.predicted_peak_bytes)


def _device_copies(p: torch.Tensor, s: Optional[dict]) -> dict:
    """A parameter's CPU optimizer state, when it has one, copied to the parameter's device (the entries to
    put in its state); nothing changes until the caller puts them. Moments kept in bf16 or 8bit on the host are
    decoded to fp32 (the share keeps fp32: module doc)."""
    if not s or "master" not in s:
        return {}
    moments = {k: s[k] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in s}
    if _C.moment_format(moments["exp_avg"]) != "fp32":
        moments["exp_avg"], moments["exp_avg_sq"] = _C.decode_moments(
            moments["exp_avg"].reshape(-1).contiguous(), moments["exp_avg_sq"].reshape(-1).contiguous(), p.numel())
    out = {k: m.to(p.device, torch.float32).view_as(p) for k, m in moments.items()}
    out["master"] = p.detach() if p.dtype == torch.float32 else s["master"].to(p.device).view_as(p)
    return out


#: Device bytes the GPU share's states may take (optimizer/include/tierflow/optimizer/grad_buckets.hpp).
gpu_share_room = _C.gpu_share_room
