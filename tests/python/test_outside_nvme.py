"""What a model saves outside its blocks goes to NVMe when that is the plan's only choice that fits (Note
[Activation planner], Outside the blocks; issue 41 item 2): the model-level hook packs them to NVMe
(PackTarget::kOutsideNvme), the run stays the baseline's bit for bit."""

import tierflow
from harness import assert_bit_identical, train
from test_outside_blocks import wide_head_task
from test_plans import OPT_NONE, _budgets_for, _profile_and_plan


def test_when_neither_the_device_nor_the_host_holds_them_they_go_to_nvme(tmp_path, device, nvme_dir):
    task = wide_head_task()
    base = train(task, 4, False, device=device)
    measured, profile, path = _profile_and_plan(tmp_path, task, device, replan="off", nvme_paths=nvme_dir)
    assert profile["links"]["nvme_write"] > 0 and profile["links"]["nvme_read"] > 0, profile["links"]
    budgets = _budgets_for(measured, profile)
    outside = budgets["outside_saved_bytes"]
    transient = max(b["transient_bytes"] for b in profile["blocks"])
    floor = tierflow.activations.plans.plan(profile["blocks"], profile["links"], dict(budgets, outside_saved_bytes=0),
                                            mode="recompute")["predicted_device_peak_bytes"]
    # Kept, they need `transient` more than the device budget; the host budget is below them, but stages the
    # largest of them (the logits' log-softmax) on its way to NVMe (Note [Staged pipeline]).
    logits = 4 * 64 * 4096 * 4
    host = logits + 32 * 1024
    assert host < outside, (host, outside)
    tier = train(task, 4, True, device=device, profile=path, gpu_memory=str(floor + outside - transient),
                 host_memory=str(host), nvme_paths=nvme_dir, replan="off", **OPT_NONE)
    assert_bit_identical(base, tier)
    p = tier.report["plan"]
    assert p["outside_kept"] is False and p["outside_tier"] == "nvme", p
    assert "swapped to NVMe" in p["summary"], p["summary"]
    # The timed step measured the largest of them and the profile carries it to the planner's budgets
    # (Budgets::outside_largest_bytes): the host's row counts its staging (not counted, it read 0), which leaves
    # the host budget 32 KiB, and what the blocks swap goes to NVMe.
    assert profile["outside_largest_bytes"] == logits and budgets["outside_largest_bytes"] == logits, budgets
    plan = tier.session.planner.plan
    assert p["outside_staging_bytes"] == plan["outside_staging_bytes"] == logits, p
    assert logits <= plan["host_bytes"] <= host, plan
    swapped = [b for b in plan["blocks"] if b["swap_bytes"] > 0]
    assert swapped and all(b["tier"] == "nvme" for b in swapped), plan["blocks"]
    acts = tier.report["activations"]
    # The model-level hook sent them to NVMe every step, and still counted them as what is saved outside.
    assert acts["nvme"]["write_bytes"] >= 4 * outside * 0.99 and acts["host_fallbacks"] == 0, acts
    assert acts["policy_bytes"] >= 4 * outside * 0.99, acts
    # ... and the largest of them, their host staging on the way (Budgets::outside_largest_bytes).
    assert acts["policy_largest_bytes"] == logits, acts
