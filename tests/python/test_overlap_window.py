"""Note [Overlap window]: under a plan that swaps, the prefetch window (and the bound on copies to the host) is
the largest swap of two neighbouring blocks (a block's copies and the last of the block before's) where the device
budget has room, so no block's swap waits inside its compute."""

import json

import tierflow
from harness import assert_bit_identical, gpt_task, train
from test_plans import OPT_NONE, _budgets_for, _profile_and_plan


def test_the_window_grows_to_two_neighbouring_blocks_swap_within_the_budget(tmp_path, device):
    task = gpt_task()
    base = train(task, 4, False, device=device)
    measured, profile, path = _profile_and_plan(tmp_path, task, device)
    # A link far faster than the blocks' compute: swapping costs nothing, so within a budget that holds no more
    # than one block's working set the plan swaps every block, whatever the times measured here.
    profile["links"].update(d2h=1e15, h2d=1e15, duplex=2e15, compute_share_during_copies=1.0)
    with open(path, "w") as f:
        json.dump(profile, f)
    budgets = _budgets_for(measured, profile)
    configured = budgets["prefetch_bytes"]
    swap_all = tierflow.activations.plans.plan(profile["blocks"], profile["links"], budgets, mode="swap")
    swaps = [b["swap_bytes"] for b in swap_all["blocks"]]
    wanted = max(a + b for a, b in zip([0] + swaps, swaps))
    assert wanted > configured, (wanted, configured)  # OPT_NONE's 256 KiB: less than a block's saved bytes
    for room in ((wanted - configured) // 2, (wanted - configured) // 4):
        # Swap every block (keep-everything's peak is out of reach), with `room` beside the plan's peak.
        budget = swap_all["predicted_device_peak_bytes"] + room
        tier = train(task, 4, True, device=device, profile=path, gpu_memory=str(budget), replan="off", **OPT_NONE)
        assert_bit_identical(base, tier)
        plan = tier.report["plan"]
        assert plan["modes"] == ["swap", "swap"], plan
        assert plan["window_wanted_bytes"] == wanted, plan
        # Grown into the room the budget left beside the plan (what the tensors outside the blocks leave of it,
        # when the plan keeps them), to the budget's edge.
        assert configured < plan["window_bytes"] <= configured + room, plan
        assert plan["predicted_device_peak_bytes"] == budget, plan


def test_a_plan_that_swaps_nothing_keeps_the_configured_window(tmp_path, device):
    tier, profile, _ = _profile_and_plan(tmp_path, gpt_task(), device)
    plan = tier.report["plan"]
    assert plan["modes"] == ["keep", "keep"] and plan["window_wanted_bytes"] == 0, plan
    assert plan["window_bytes"] == _budgets_for(tier, profile)["prefetch_bytes"]
