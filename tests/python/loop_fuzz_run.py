"""One run of a generated training loop (tests/python/loop_fuzz.py, issue 37 part 4): plain PyTorch or with
``tierflow.wrap``, from the loop's seed and data, recording the losses, the final state, what the hooks saw and
the gradients each step stepped from."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import loop_fuzz_loop  # noqa: F401  (first: the process's set-up, before torch)
import torch
import torch.nn as nn

import tierflow
from loop_fuzz_loop import LR, Loop
from loop_fuzz_zoo import batch, blocks_of, loss_of, make_model


class Refused(Exception):
    """tierflow refused the loop: the error, and when (wrap, or the step it was raised in)."""

    def __init__(self, error: BaseException, at: str) -> None:
        super().__init__(f"{at}: {type(error).__name__}: {error}")
        self.error, self.at = error, at


@dataclass
class Result:
    losses: list
    state: dict          # the model's state_dict at the end: parameters and buffers
    hook_log: list       # what the forward hooks saw, in order
    grads_seen: list     # the norm of the gradients each step stepped from (what the loop read)


@contextlib.contextmanager
def world_of_one(enabled: bool):
    """A gloo process group of this process alone, for DDP (conftest.world_of_one's), gone after."""
    dist = torch.distributed
    if not enabled or dist.is_initialized():
        yield
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run(loop: Loop, use_tierflow: bool, nvme_dir: Optional[str] = None) -> Result:
    """The loop, without or with tierflow (raising Refused for a TierflowError from tierflow's run)."""
    with world_of_one(loop.ddp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _run(loop, use_tierflow, nvme_dir)


def _optimizer(loop: Loop, model: nn.Module) -> torch.optim.Optimizer:
    """The loop's optimizer over the model's trainable parameters (frozen ones left out), in one or two groups."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if loop.two_groups:
        groups = [{"params": [p for p in trainable if p.dim() > 1]},
                  {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    else:
        groups = trainable
    return {"AdamW": lambda: torch.optim.AdamW(groups, lr=LR, weight_decay=0.01),
            "Adam": lambda: torch.optim.Adam(groups, lr=LR, weight_decay=0.01),
            "SGD": lambda: torch.optim.SGD(groups, lr=1e-2, momentum=0.9)}[loop.optimizer]()


def _hook(loop: Loop, model: nn.Module, hook_log: list) -> None:
    """The loop's forward hook on the last block, observing (into `hook_log`) or changing its output."""
    if loop.hook == "none":
        return
    target = blocks_of(model)[-1]

    def hook(module, args, out):
        out_f = out.detach().float()
        hook_log.append((float(out_f.sum()), float(out_f.abs().sum())))
        if loop.hook == "modify":
            return out * 0.75

    target.register_forward_hook(hook)


def _make_scheduler(o):
    return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7)


def _forward_backward(loop: Loop, model: nn.Module, scaler, step: int) -> float:
    """The step's forwards and backwards (accumulated, under no_sync, autocast, retain_graph as the loop says);
    returns the step's loss."""
    total = 0.0
    for micro in range(loop.accumulate):
        sync = model.no_sync() if loop.no_sync and micro < loop.accumulate - 1 else contextlib.nullcontext()
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if loop.autocast else contextlib.nullcontext()
        i = step * loop.accumulate + micro
        with sync:
            with amp:
                loss = loss_of(model, batch(loop, 2 * i))
                if loop.two_forwards:
                    loss = 0.5 * (loss + loss_of(model, batch(loop, 2 * i + 1)))
            loss = loss / loop.accumulate
            if loop.scaler == "skip_first" and step == 0 and micro == 0:
                loss = loss * float("inf")  # an overflow (a bad batch): the scaler skips the step
            scaled = scaler.scale(loss) if scaler is not None else loss
            if loop.retain_graph:
                scaled.backward(retain_graph=True)
                (0.5 * scaled).backward()
            else:
                scaled.backward()
        total += float(loss.detach())
    return total


def _step(loop: Loop, opt, scaler, params: list, step: int, use_tierflow: bool) -> float:
    """What the loop does between backward and zero_grad: its gradient and weight edits, the clip, the optimizer's
    step (through the scaler); returns the norm of the gradients stepped from."""
    _edit_grads(loop, params, step)
    if loop.weight_edit == "scale_before_step":
        with torch.no_grad():
            for p in params:
                p.data.mul_(0.99)
    if scaler is not None and loop.clip != "none":
        # A clip is of the true gradients: unscaled first (tierflow's max_grad_norm clips in step(),
        # which the scaler reaches after its own unscale_; the baseline's clip_grad_norm_ stands for it).
        scaler.unscale_(opt)
    _clip(loop, params, use_tierflow)
    seen = _grad_norm(params)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    if loop.weight_edit == "clip_after_step":  # WGAN's weight clipping
        for p in params:
            p.data.clamp_(-0.05, 0.05)
    return seen


def _after_step(loop: Loop, model: nn.Module, opt, step: int, saved):
    """An eval forward, and state_dict saved and loaded (in place, or rolled back a step later); returns what is
    saved."""
    if loop.eval_forward:
        model.eval()
        with torch.no_grad():
            loss_of(model, batch(loop, 10_000 + step))
        model.train()
    if loop.save_load != "none" and step == loop.save_at:
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        if loop.save_load == "in_place":
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
    elif loop.save_load == "rollback" and saved is not None and step == loop.save_at + 1:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    return saved


def _run(loop: Loop, use_tierflow: bool, nvme_dir: Optional[str]) -> Result:
    torch.manual_seed(loop.seed)
    model = make_model(loop)
    if loop.frozen:  # the first block and the input side frozen, as in a partial fine-tune
        for p in blocks_of(model)[0].parameters():
            p.requires_grad_(False)
    opt = _optimizer(loop, model)
    hook_log: list = []
    _hook(loop, model, hook_log)
    if loop.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    sched = _make_scheduler(opt) if loop.scheduler == "before" else None
    at = "wrap"
    try:
        if use_tierflow:
            model, opt = tierflow.wrap(model, opt, device="emulated", **loop.settings(nvme_dir))
        if loop.scheduler == "after":
            sched = _make_scheduler(opt)
        scaler = None
        if loop.scaler != "none":
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        params = [p for p in model.parameters() if p.requires_grad]
        losses, grads_seen, saved = [], [], None
        for step in range(loop.steps):
            at = f"step {step}"
            if loop.zero_grad.startswith("start"):
                opt.zero_grad(set_to_none=loop.zero_grad == "start_none")
            total = _forward_backward(loop, model, scaler, step)
            grads_seen.append(_step(loop, opt, scaler, params, step, use_tierflow))
            if loop.zero_grad.startswith("end"):
                opt.zero_grad(set_to_none=loop.zero_grad == "end_none")
            if sched is not None:
                sched.step()
            saved = _after_step(loop, model, opt, step, saved)
            losses.append(total)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    except (tierflow.TierflowError, tierflow.ConfigError, tierflow.OutOfMemoryError) as e:
        if not use_tierflow:
            raise
        raise Refused(e, at) from e
    finally:
        if use_tierflow:
            inner = model.module if loop.ddp and hasattr(model, "module") else model
            with contextlib.suppress(Exception):
                tierflow.unwrap(inner if getattr(inner, "_tierflow_session", None) is not None else model)
    return Result(losses, state, hook_log, grads_seen)


def _edit_grads(loop: Loop, params: list, step: int) -> None:
    """The user's own gradient edits after backward; `.data` edits do not bump the gradient's version."""
    for k, p in enumerate(params if loop.grad_edit != "none" else ()):
        if p.grad is None:
            continue
        # A factor that changes with the step and the parameter: Adam does not see a constant one.
        factor = (0.25, 1.0, 4.0)[(step + k) % 3]
        if loop.grad_edit == "data_scale":
            p.grad.data.mul_(factor)
        elif loop.grad_edit == "inplace_scale":
            p.grad.mul_(factor)
        elif loop.grad_edit in ("data_allreduce", "inplace_allreduce"):
            # A hand-written all-reduce (`dist.all_reduce(p.grad.data); p.grad.data /= world`) over two ranks,
            # emulated in one process: the other rank's gradient is a fixed tensor.
            other = torch.randn(p.grad.shape, generator=torch.Generator().manual_seed(31 * step + k)) * 1e-3
            g = p.grad.data if loop.grad_edit == "data_allreduce" else p.grad
            g.add_(other.to(p.grad.dtype)).div_(2)
    for p in params:
        if p.grad is None:
            continue
        if loop.grad_negate:
            p.grad.data.neg_()
        if loop.grad_strides and p.grad.dim() == 2:
            p.grad = p.grad.t().contiguous().t()


def _clip(loop: Loop, params: list, use_tierflow: bool) -> None:
    if loop.clip == "torch" or (loop.clip == "tierflow" and not use_tierflow):
        torch.nn.utils.clip_grad_norm_(params, loop.max_norm)
    elif loop.clip in ("manual", "manual_data"):
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        coef = torch.clamp(loop.max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            (g.data if loop.clip == "manual_data" else g).mul_(coef.to(g.dtype))


def _grad_norm(params: list) -> float:
    gs = [p.grad.float().norm() for p in params if p.grad is not None]
    return float(torch.stack(gs).norm()) if gs else 0.0
