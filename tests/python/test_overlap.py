"""Stepping during backward (Note [Step during backward]) gives the results of a plain step."""

import math

import pytest
import torch

import tierflow
from harness import gpt_task, subprocess_environment
from children import run_child


def run(task, steps, use_tierflow, *, device, clip=None, poison=None, scale_grads=None, skip_on_nonfinite=False,
        accumulate=1, **settings):
    """Trains `steps` steps on `device`. clip: user clip_grad_norm_ after backward. poison: {step: param
    index} puts an inf into that gradient. scale_grads: in-place gradient change after backward."""
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if use_tierflow:
        model, opt = tierflow.wrap(model, opt, device=device, **settings)
    losses, early = [], []
    params = list(model.parameters())
    for step in range(steps):
        for micro in range(accumulate):
            loss = task.loss(model, task.batch_on(step * accumulate + micro, device))
            (loss / accumulate).backward()
        if use_tierflow:
            early.append(opt.has_unconfirmed_steps())
        if poison and step in poison:
            params[poison[step]].grad.view(-1)[0] = float("inf")
        if scale_grads:
            for p in params:
                p.grad.mul_(scale_grads)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        grads_finite = all(torch.isfinite(p.grad).all() for p in params)
        if use_tierflow or not skip_on_nonfinite or grads_finite:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, (opt.overlap_stats if use_tierflow else None), early


def same(a, b):
    assert a[0] == b[0]
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


def close(a, b, equal_nan=False):
    for x, y in zip(a[0], b[0]):
        assert (math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-6 * abs(x), (x, y)
    for k in a[1]:
        torch.testing.assert_close(b[1][k], a[1][k], rtol=1e-6, atol=5e-5, equal_nan=equal_nan, msg=k)


def test_steps_happen_during_backward_and_match_stepping_after(device):
    task = gpt_task(dropout=0.0)
    on = run(task, 4, True, device=device, overlap_step="on")
    off = run(task, 4, True, device=device, overlap_step="off")
    same(on, off)  # the same kernel on the same gradients: bit-identical
    stats = on[2]
    assert all(on[3]), "after backward() returns, the early steps are already there"
    assert stats["early_steps"] > 0 and stats["committed"] == stats["early_steps"]
    assert stats["redone"] == 0 and stats["taken_back"] == 0


def test_user_clip_grad_norm_after_backward_is_honoured(device):
    task = gpt_task(dropout=0.0)
    base = run(task, 4, False, device=device, clip=0.05)
    tier = run(task, 4, True, device=device, clip=0.05)
    close(base, tier)
    assert tier[2]["redone"] > 0, "clipping changed the gradients: the early steps must be redone"


def test_max_grad_norm_setting_equals_clip_grad_norm_then_step(device):
    task = gpt_task(dropout=0.0)
    base = run(task, 4, False, device=device, clip=0.05)
    tier = run(task, 4, True, device=device, max_grad_norm=0.05)
    close(base, tier)
    # Exactly what tierflow does with the user's own clip and no overlap.
    same(tier, run(task, 4, True, device=device, clip=0.05, overlap_step="off"))
    # A norm bound that never binds changes nothing and keeps every early step.
    loose = run(task, 4, True, device=device, max_grad_norm=1e6)
    same(loose, run(task, 4, True, device=device))
    assert loose[2]["redone"] == 0


def test_inf_gradient_under_user_clipping_matches_torch(device):
    task = gpt_task(dropout=0.0)
    base = run(task, 3, False, device=device, clip=1.0, poison={1: 3})
    tier = run(task, 3, True, device=device, clip=1.0, poison={1: 3})
    close(base, tier, equal_nan=True)  # torch turns the parameters to NaN; so must we, identically


def test_skip_nonfinite_skips_the_step_and_keeps_the_state(device):
    task = gpt_task(dropout=0.0)
    base = run(task, 4, False, device=device, poison={1: 3}, skip_on_nonfinite=True)
    tier = run(task, 4, True, device=device, poison={1: 3}, skip_nonfinite="on")
    close(base, tier)
    assert tier[2]["skipped_steps"] == 1 and tier[2]["taken_back"] > 0
    assert all(torch.isfinite(v).all() for v in tier[1].values() if v.is_floating_point())


def test_in_place_gradient_change_after_backward_is_seen(device):
    task = gpt_task(dropout=0.0)
    base = run(task, 3, False, device=device, scale_grads=0.5)
    tier = run(task, 3, True, device=device, scale_grads=0.5)
    close(base, tier)
    assert tier[2]["redone"] > 0


@pytest.mark.parametrize("hint", [1, 3])
def test_gradient_accumulation_with_and_without_the_hint(hint, device):
    task = gpt_task(dropout=0.0)
    base = run(task, 3, False, device=device, accumulate=3)
    tier = run(task, 3, True, device=device, accumulate=3, grad_accumulation_steps=hint)
    close(base, tier)
    if hint == 3:
        assert tier[2]["committed"] > 0 and tier[2]["taken_back"] == 0
    else:
        assert tier[2]["taken_back"] > 0  # a wrong hint costs redone work, not correctness


def test_state_dict_between_backward_and_step_has_only_confirmed_state(device):
    task = gpt_task(dropout=0.0)
    torch.manual_seed(0)
    model = task.model_on(device)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    task.loss(model, task.batch_on(0, device)).backward()
    assert opt.has_unconfirmed_steps()
    # A parameter of the runtime's device (CUDA, or a CPU tensor on the emulated device) gets its
    # new value only when step() confirms it (Note [Step during backward]).
    for k, p in model.named_parameters():
        assert torch.equal(p, before[k]), f"{k} changed before step()"
    sd = opt.state_dict()
    assert all(float(s["step"]) == 0.0 for s in sd["state"].values())  # early steps are not in the state
    opt.zero_grad()  # no step(): every early step is taken back
    assert not opt.has_unconfirmed_steps()
    for k, p in model.named_parameters():
        assert torch.equal(p, before[k]), k


def test_dropping_everything_with_early_steps_queued_does_not_hang(device):
    import os
    import subprocess
    import sys
    import textwrap

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = textwrap.dedent(f"""
        import gc, sys, torch
        sys.path[:0] = [{os.path.join(root, 'bindings', 'python')!r}, {os.path.join(root, 'examples')!r},
                        {os.path.join(root, 'tests', 'python')!r}]
        import tierflow, tierflow._wrap as w
        from harness import gpt_task
        task = gpt_task()
        for _ in range(3):
            model = task.model_on({device!r})
            model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device={device!r})
            task.loss(model, task.batch_on(0, {device!r})).backward()   # early steps queued on the worker
            del opt, model
            w._sessions.clear()
            gc.collect()                                      # the runtime goes while they may still run
        print("ok")
    """)
    out = run_child([sys.executable, "-c", script], capture_output=True, text=True,
                    env=subprocess_environment())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
