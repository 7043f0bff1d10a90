"""What a model saves outside its repeated blocks (the head's logits above all) is in the plan (Note [Activation
planner], Outside the blocks): measured in the timed step, kept on the device or swapped to the host whole,
whichever predicts the faster step within the budgets; the run stays the baseline's either way."""

import json
import os
import sys

import torch

import tierflow
from harness import Task, assert_bit_identical, train
from test_plans import OPT_NONE, _budgets_for, _profile_and_plan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import gpt_model  # noqa: E402


class WithLoss(torch.nn.Module):
    """The loss inside the model's forward, as transformers' models compute it when given labels: its saved
    tensors (the log-softmax of the logits) are saved outside the blocks, within the model's forward."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.gpt = gpt_model.GPT(cfg)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return gpt_model.lm_loss(self.gpt(x), y)


def wide_head_task() -> Task:
    """Two thin blocks under a wide vocabulary: the logits outweigh everything the blocks save."""
    cfg = gpt_model.GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=64, vocab_size=4096)

    def batch_fn(i: int) -> tuple:
        x = torch.randint(0, 4096, (4, 65), generator=torch.Generator().manual_seed(5000 + i))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    return Task(lambda: WithLoss(cfg), batch_fn, lambda m, b: m(b[0], b[1]))


def _profile(tmp_path, task, device):
    return _profile_and_plan(tmp_path, task, device, replan="off")


def test_the_tensors_outside_the_blocks_are_measured_and_kept_when_they_fit(tmp_path, device):
    task = wide_head_task()
    base = train(task, 4, False, device=device)
    measured, profile, path = _profile(tmp_path, task, device)
    logits = 4 * 64 * 4096 * 4  # fp32: at least the loss's log-softmax of the logits is saved outside the blocks
    assert profile["outside_saved_bytes"] >= logits, profile
    plan = measured.report["plan"]
    assert plan["modes"] == ["keep", "keep"] and plan["outside_kept"] is True and plan["outside_tier"] == "gpu", plan
    assert plan["outside_bytes"] == profile["outside_saved_bytes"]
    assert_bit_identical(base, measured)


def test_when_they_do_not_fit_beside_the_blocks_they_go_to_the_host(tmp_path, device):
    task = wide_head_task()
    base = train(task, 4, False, device=device)
    measured, profile, path = _profile(tmp_path, task, device)
    budgets = _budgets_for(measured, profile)
    outside = budgets["outside_saved_bytes"]
    assert outside == profile["outside_saved_bytes"] > 0
    without = dict(budgets, outside_saved_bytes=0)
    floor = tierflow.activations.plans.plan(profile["blocks"], profile["links"], without,
                                            mode="recompute")["predicted_device_peak_bytes"]
    # Swapped, they are still on the device where they are made and come back, when no block's working set is
    # (Note [Activation planner]): the peak adds what they exceed the largest transient bytes by.
    transient = max(b["transient_bytes"] for b in profile["blocks"])
    assert outside > transient, (outside, transient)
    budget = floor + outside - transient
    # The case: kept, they need `transient` more than the budget beside the cheapest blocks' plan; swapped, that
    # plan fits exactly, and no block can be kept. Only one plan fits, whatever the times.
    tier = train(task, 4, True, device=device, profile=path, gpu_memory=str(budget), replan="off", **OPT_NONE)
    assert_bit_identical(base, tier)
    p = tier.report["plan"]
    assert p["outside_kept"] is False and p["outside_tier"] == "host" and "keep" not in p["modes"], p
    assert p["outside_swap_seconds"] > 0 and p["predicted_device_peak_bytes"] <= budget, p
    assert "outside the blocks" in p["summary"] and "swapped to the host" in p["summary"], p["summary"]
    # The model-level hooks swapped them: every step offloaded at least the logits.
    assert tier.report["activations"]["offloaded_bytes"] >= 4 * outside * 0.99, tier.report["activations"]


def test_a_profile_without_them_keeps_the_hooks_it_was_planned_with(tmp_path, device):
    """A profile written before they were measured (no outside_saved_bytes): a plan that moves a block swaps
    them through the model-level hooks, as such a plan did then."""
    task = wide_head_task()
    base = train(task, 4, False, device=device)
    measured, profile, path = _profile(tmp_path, task, device)
    budgets = _budgets_for(measured, profile)
    floor = tierflow.activations.plans.plan(profile["blocks"], profile["links"], dict(budgets, outside_saved_bytes=0),
                                            mode="recompute")["predicted_device_peak_bytes"]
    del profile["outside_saved_bytes"]
    with open(path, "w") as f:
        json.dump(profile, f)
    tier = train(task, 4, True, device=device, profile=path, gpu_memory=str(floor), replan="off", **OPT_NONE)
    assert_bit_identical(base, tier)
    assert "keep" not in tier.report["plan"]["modes"], tier.report["plan"]
    assert tier.report["activations"]["offloaded_bytes"] >= 4 * 4 * 64 * 4096 * 4 * 0.99, tier.report["activations"]
