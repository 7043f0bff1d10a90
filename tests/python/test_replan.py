"""Note [Re-plan]: a plan whose steps stray from its whole-step prediction is made once more from figures
calibrated on them; the run stays the baseline's, bit for bit, across the change."""

import json
import time

import pytest

import tierflow
from harness import assert_bit_identical, gpt_task, train
from test_plans import OPT_NONE, _budgets_for, _profile_and_plan

STEPS = 8


def _tight_budget(measured, profile) -> int:
    """A device budget a third of the way from recompute-everything's peak to keep-everything's: the plan moves
    bytes over the link."""
    budgets = _budgets_for(measured, profile)
    floor = tierflow.activations.plans.plan(profile["blocks"], profile["links"], budgets, mode="recompute")
    everything = tierflow.activations.plans.plan(profile["blocks"], profile["links"], budgets, mode="keep")
    low = floor["predicted_device_peak_bytes"]
    return low + (everything["predicted_device_peak_bytes"] - low) // 3


def _slow_steps(planned: list):
    """The user's own work between steps, twice as long as the plan's whole predicted step: every measured step
    takes at least twice the prediction, beyond any margin."""
    def after_step(step: int) -> None:
        plan = tierflow.report()["plan"]
        planned.append(dict(plan))
        time.sleep(max(0.02, 2 * (plan.get("predicted_step_seconds") or 0.0)))
    return after_step


def test_steps_that_stray_replan_once_and_the_run_stays_the_baselines(tmp_path, device, capfd):
    task = gpt_task()
    base = train(task, STEPS, False, device=device)
    measured, profile, path = _profile_and_plan(tmp_path, task, device)
    budget = _tight_budget(measured, profile)
    seen: list = []
    tier = train(task, STEPS, True, device=device, profile=path, gpu_memory=str(budget), after_step=_slow_steps(seen),
                 log_level="info", **OPT_NONE)  # the re-plan's line is info (Note [Plan messages])
    assert_bit_identical(base, tier)
    plan = tier.report["plan"]
    r = plan["replanned"]
    assert r is not None and r["replanned"] is True, plan
    # Four steps under the profile's plan (made before the first forward; the first is not judged: it pins the
    # host memory the plan needs), then the one re-plan.
    assert r["steps"] == 3 and r["measured_step_seconds"] >= 2 * r["predicted_step_seconds"] * 0.99, r
    assert r["link_factor"] < 1 or r["compute_factor"] > 1, r
    assert "measured step" in r["why"] and ("link speed x" in r["why"] or "compute x" in r["why"]), r
    assert [s["replanned"] for s in seen[:4]] == [None] * 4 and all(s["replanned"] == r for s in seen[4:]), seen
    # From then on the new plan's steps are measured, and nothing re-plans again however far they stray.
    assert plan["measured"]["steps"] == STEPS - 5, plan
    assert plan["step_vs_predicted"] > 1 + tierflow._C.REPLAN_MARGIN, plan
    assert not tierflow.current_session().planner.phases.may_replan
    assert capfd.readouterr().err.count("re-planning once") == 1
    # TIERFLOW_PROFILE now holds the calibrated figures: the next run starts from them.
    with open(path) as f:
        saved = json.load(f)
    assert saved["calibrated"]["link_factor"] == r["link_factor"], saved
    assert saved["links"]["d2h"] == pytest.approx(profile["links"]["d2h"] * r["link_factor"])
    assert saved["blocks"][0]["forward_seconds"] == pytest.approx(
        profile["blocks"][0]["forward_seconds"] * r["compute_factor"])


def test_replan_off_keeps_the_first_plan(tmp_path, device):
    task = gpt_task()
    measured, profile, path = _profile_and_plan(tmp_path, task, device)
    seen: list = []
    tier = train(task, 5, True, device=device, profile=path, gpu_memory=str(_tight_budget(measured, profile)),
                 after_step=_slow_steps(seen), replan="off", **OPT_NONE)
    plan = tier.report["plan"]
    assert plan["replanned"] is None and plan["measured"]["steps"] == 4, plan
    assert plan["step_vs_predicted"] > 1 + tierflow._C.REPLAN_MARGIN, plan
    assert all(s["modes"] == plan["modes"] for s in seen)


def test_a_plan_that_keeps_everything_is_not_replanned_and_says_why(tmp_path, device, capfd):
    task = gpt_task()
    base = train(task, STEPS, False, device=device)
    seen: list = []
    tier = train(task, STEPS, True, device=device, after_step=_slow_steps(seen), log_level="info", **OPT_NONE)
    assert_bit_identical(base, tier)
    plan = tier.report["plan"]
    assert plan["modes"] == ["keep", "keep"], plan
    r = plan["replanned"]
    assert r is not None and r["replanned"] is False and "keeps every block" in r["why"], plan
    assert "no re-plan" in capfd.readouterr().err


def test_the_rest_of_the_step_is_measured_in_the_timed_step(tmp_path, device):
    """The profile carries the timed step's wall time less its blocks' (tiering::rest_of_step_seconds); the
    plan's whole predicted step adds it to the blocks' part."""
    tier, profile, _path = _profile_and_plan(tmp_path, gpt_task(), device)
    plan = tier.report["plan"]
    assert profile["rest_of_step_seconds"] > 0
    assert plan["rest_of_step_seconds"] == profile["rest_of_step_seconds"]
    assert plan["predicted_step_seconds"] == pytest.approx(plan["predicted_blocks_seconds"] + plan["rest_of_step_seconds"])
