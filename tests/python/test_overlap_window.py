"""Note [Overlap window]: under a plan that swaps, the prefetch window (and the bound on copies to the host) is
the largest block's swap where the device budget has room, so no block's swap waits inside its compute."""

import tierflow
from harness import assert_bit_identical, gpt_task, train
from test_plans import OPT_NONE, _budgets_for, _profile_and_plan


def test_the_window_grows_to_the_largest_blocks_swap_within_the_budget(tmp_path, device):
    task = gpt_task()
    base = train(task, 4, False, device=device)
    measured, profile, path = _profile_and_plan(tmp_path, task, device)
    budgets = _budgets_for(measured, profile)
    configured = budgets["prefetch_bytes"]
    swap_all = tierflow.activations.plans.plan(profile["blocks"], profile["links"], budgets, mode="swap")
    wanted = max(b["swap_bytes"] for b in swap_all["blocks"])
    assert wanted > configured, (wanted, configured)  # OPT_NONE's 256 KiB: less than a block's saved bytes
    grown = []
    for room in ((wanted - configured) // 2, (wanted - configured) // 4):
        # Swap every block (keep-everything's peak is out of reach), with `room` beside the plan's peak.
        budget = swap_all["predicted_device_peak_bytes"] + room
        tier = train(task, 4, True, device=device, profile=path, gpu_memory=str(budget), replan="off", **OPT_NONE)
        assert_bit_identical(base, tier)
        plan = tier.report["plan"]
        assert plan["predicted_device_peak_bytes"] <= budget, plan
        assert plan["window_bytes"] >= configured, plan
        assert plan["window_wanted_bytes"] >= plan["window_bytes"] or plan["window_bytes"] == configured, plan
        if plan["window_wanted_bytes"] > configured:
            # Grown as far as the budget lets it: to what it wants, or to the budget's edge.
            assert plan["window_bytes"] == plan["window_wanted_bytes"] or \
                plan["predicted_device_peak_bytes"] == budget, plan
        grown.append(plan["window_bytes"] > configured)
    assert any(grown), "some room was left beside a plan that swaps"


def test_a_plan_that_swaps_nothing_keeps_the_configured_window(tmp_path, device):
    tier, profile, _ = _profile_and_plan(tmp_path, gpt_task(), device)
    plan = tier.report["plan"]
    assert plan["modes"] == ["keep", "keep"] and plan["window_wanted_bytes"] == 0, plan
    assert plan["window_bytes"] == _budgets_for(tier, profile)["prefetch_bytes"]
