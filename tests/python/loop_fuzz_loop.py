"""The training-loop fuzzer's loop description (tests/python/loop_fuzz.py, issue 37 part 4): ``Loop``, one
generated training loop as plain values, and ``draw(seed)``, which composes one from a seed. Importing it first
sets up the process as the fuzzer's runs need (bit-for-bit matmuls, tierflow and examples/ on the path)."""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Optional

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")  # before torch: bit-for-bit matmuls (tests/python/conftest.py)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (os.path.join(ROOT, "bindings", "python"), os.path.join(ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The CPU AdamW's rounding of torch's AdamW, over a loop's few steps (harness.assert_close: ~1 ulp per step;
# parameters whose exact gradient is zero drift by Adam's lr-sized steps of rounding noise). Under bf16 autocast a
# 1-ulp difference in a weight can flip a bf16 rounding in the forward: the losses then agree to bf16's precision.
LR = 1e-3
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-5, 5e-5
AUTOCAST_LOSS_RTOL, AUTOCAST_PARAM_ATOL = 2e-2, 2e-3

MODELS = ("gpt_tied", "mlp_bn", "cnn_bn", "encoder")
ACTIVATIONS = ("none", "host", "recompute", "auto", "nvme")
OPTIMIZER_OFFLOAD = ("none", "host", "nvme")


# ---- the loop's description ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    """One generated training loop: the model, tierflow's settings and the idioms, all plain values."""
    seed: int
    model: str = "mlp_bn"
    dropout: float = 0.0
    steps: int = 3
    # tierflow's settings
    acts: str = "none"
    opt_offload: str = "none"
    offload_params: str = "none"
    overlap_step: str = "on"
    weights_return: str = "step"
    offload_gradients: str = "off"
    tight_gpu: bool = False          # auto under a budget that makes it swap or recompute
    tell_accumulation: bool = False  # grad_accumulation_steps=accumulate
    skip_nonfinite: bool = False
    # the optimizer
    optimizer: str = "AdamW"         # AdamW, Adam (L2 decay), SGD
    two_groups: bool = False
    scheduler: str = "none"          # none, before, after (wrap)
    # idioms
    grad_edit: str = "none"          # none, data_scale, data_allreduce, inplace_scale, inplace_allreduce
    clip: str = "none"               # none, torch, tierflow, manual, manual_data
    max_norm: float = 1.0
    scaler: str = "none"             # none, on, skip_first
    accumulate: int = 1
    ddp: bool = False                # DistributedDataParallel in a world of one
    no_sync: bool = False
    zero_grad: str = "end_none"      # end_none, end_zeros, start_none, start_zeros
    frozen: bool = False
    hook: str = "none"               # none, observe, modify
    two_forwards: bool = False
    retain_graph: bool = False
    autocast: bool = False
    eval_forward: bool = False
    save_load: str = "none"          # none, in_place, rollback
    save_at: int = 1
    # drawn after the rest (the earlier fields of a seed's loop are what they were before these came)
    weight_edit: str = "none"        # none, clip_after_step (WGAN: p.data.clamp_), scale_before_step
    grad_negate: bool = False        # p.grad.data.neg_() after backward (sign flips only)
    grad_strides: bool = False       # p.grad replaced by the same values in other strides

    def line(self) -> str:
        """The loop in one line: what differs from the defaults (the seed always)."""
        fields = [f"seed={self.seed}"]
        for f in dataclasses.fields(self):
            if f.name != "seed" and getattr(self, f.name) != f.default:
                fields.append(f"{f.name}={getattr(self, f.name)!r}")
        return "Loop(" + ", ".join(fields) + ")"

    def settings(self, nvme_dir: Optional[str]) -> dict:
        """tierflow.wrap's keywords for this loop."""
        s: dict[str, Any] = dict(offload_activations=self.acts, offload_optimizer=self.opt_offload)
        if self.acts != "none":  # (ignored without offloaded activations: a warning each)
            s.update(min_offload_bytes=0, prefetch_bytes="64KiB")
        if self.offload_params != "none":
            s["offload_params"] = self.offload_params
        if self.opt_offload != "none":
            s.update(overlap_step=self.overlap_step, weights_return=self.weights_return)
            if self.offload_gradients == "on":
                s["offload_gradients"] = "on"
        if self.tight_gpu:
            s["gpu_memory"] = "256KiB"
        if self.tell_accumulation:
            s["grad_accumulation_steps"] = self.accumulate
        if self.clip == "tierflow":
            s["max_grad_norm"] = self.max_norm
        if self.skip_nonfinite:
            s["skip_nonfinite"] = "on"
        if "nvme" in (self.acts, self.opt_offload, self.offload_params):
            s["nvme_paths"] = nvme_dir
        return s

    def exact(self) -> bool:
        """Whether the run with tierflow must be the baseline bit for bit: torch's own optimizer steps."""
        return self.opt_offload == "none"


def draw(seed: int) -> Loop:
    """The loop of `seed`: every choice from one random.Random(seed), within what a user could write."""
    r = random.Random(seed)
    pick = r.choice
    model = pick(MODELS)
    acts = pick(("none", "host", "recompute", "auto", "auto", "nvme"))
    opt_offload = pick(("none", "none", "host", "host", "nvme"))
    offload_params = "none"
    if r.random() < 0.15:
        offload_params = pick(("host", "auto")) if acts == "auto" else "host"
    accumulate = pick((1, 1, 2, 3))
    ddp = r.random() < 0.12
    scaler = pick(("none",) * 6 + ("on", "skip_first"))
    grad_edit = pick(("none",) * 6 + ("data_scale", "data_allreduce", "inplace_scale", "inplace_allreduce"))
    clip = pick(("none",) * 4 + ("torch", "tierflow", "manual", "manual_data"))
    touches_grads = grad_edit != "none" or clip in ("torch", "manual", "manual_data") or scaler != "none"
    optimizer = pick(("AdamW",) * 8 + ("Adam", "SGD"))
    steps = pick((2, 3, 4))
    save_load = pick(("none",) * 5 + ("in_place", "rollback"))
    loop = Loop(
        seed=seed, model=model, dropout=pick((0.0, 0.0, 0.1)), steps=steps,
        acts=acts, opt_offload=opt_offload, offload_params=offload_params,
        overlap_step=pick(("on", "on", "off")), weights_return=pick(("step", "step", "forward")),
        # Freed gradients leave p.grad None (documented): only in loops that do not read p.grad themselves.
        offload_gradients="on" if not touches_grads and r.random() < 0.15 else "off",
        tight_gpu=acts == "auto" and r.random() < 0.4,
        tell_accumulation=accumulate > 1 and r.random() < 0.5,
        skip_nonfinite=r.random() < (0.5 if scaler != "none" else 0.1),
        optimizer=optimizer, two_groups=r.random() < 0.3, scheduler=pick(("none", "none", "before", "after")),
        grad_edit=grad_edit, clip=clip, max_norm=pick((0.05, 1.0, 1e6)), scaler=scaler, accumulate=accumulate,
        ddp=ddp, no_sync=ddp and accumulate > 1 and r.random() < 0.7,
        zero_grad=pick(("end_none", "end_none", "end_zeros", "start_none", "start_zeros")),
        frozen=r.random() < 0.2, hook=pick(("none",) * 4 + ("observe", "modify")),
        two_forwards=r.random() < 0.15, retain_graph=r.random() < 0.15, autocast=r.random() < 0.15,
        eval_forward=r.random() < 0.15, save_load=save_load, save_at=r.randrange(0, max(1, steps - 1)),
    )
    if r.random() < 0.9:
        # Mostly settings that act in the loop's mode; one loop in ten keeps a setting its mode ignores: refused
        # at wrap by name when ignoring it changes results (a clip, a skip), accepted with a warning when it
        # only changes speed (Note [Settings a mode ignores]), and then it must match.
        streams = loop.opt_offload == "host" and loop.overlap_step == "on"
        loop = dataclasses.replace(
            loop, weights_return=loop.weights_return if streams else "step",
            tell_accumulation=loop.tell_accumulation and streams,
            skip_nonfinite=loop.skip_nonfinite and loop.opt_offload != "none",
            clip="torch" if loop.clip == "tierflow" and loop.opt_offload == "none" else loop.clip)
    # Weights written outside the optimizer (Note [Weight content]), where tierflow checks them: not with the
    # parameters on the host or the states on NVMe, and after step() not with TIERFLOW_WEIGHTS_RETURN=forward
    # (docs/models.md: still assumed).
    weight_edit = pick(("none",) * 6 + ("clip_after_step", "scale_before_step"))
    if loop.offload_params != "none" or loop.opt_offload == "nvme" or \
            (weight_edit == "clip_after_step" and loop.weights_return == "forward"):
        weight_edit = "none"
    free = loop.offload_gradients == "off"
    loop = dataclasses.replace(loop, weight_edit=weight_edit, grad_negate=free and r.random() < 0.1,
                               grad_strides=free and r.random() < 0.1)
    return loop
