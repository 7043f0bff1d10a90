"""The planner's structs (tierflow._C, tiering/planner.hpp) to and from the dicts of profile files and reports.

The decisions are C++ (Note [Activation planner], Note [Auto plan phases]); this module only converts."""

from __future__ import annotations

from typing import Any, Optional

from .. import _C
from .profile import BLOCK_FIELDS, LINK_FIELDS

BUDGET_FIELDS = ("device_bytes", "fixed_device_bytes", "host_bytes", "nvme_bytes", "prefetch_bytes", "params",
                 "param_tier", "rest_parameter_bytes", "outside_saved_bytes", "outside_largest_bytes")


def block_profile(fields: dict) -> Any:
    """A BlockProfile from a profile file's block (a file may leave out backward_seconds: the planner's estimate
    of kBackwardPerForward times the forward, Note [Auto plan phases])."""
    b = _C.BlockProfile(**fields)
    if "backward_seconds" not in fields:
        b.backward_seconds = _C.measured_block_profile(_C.BlockRecord(forward_seconds=b.forward_seconds)).backward_seconds
    return b


def links_struct(links: Any) -> Any:
    """Links from a profile's dict (duplex left out: both directions at their sum) or Links as they are."""
    if not isinstance(links, dict):
        return links
    out = _C.Links(**links)
    if "duplex" not in links:
        out.duplex = out.d2h + out.h2d
    return out


def budgets_struct(budgets: Any) -> Any:
    return _C.Budgets(**budgets) if isinstance(budgets, dict) else budgets


def fields_of(struct: Any, names: tuple) -> dict:
    return {k: getattr(struct, k) for k in names}


def plan_dict(plan: Any) -> dict:
    """A Plan as tierflow's report and the session read it."""
    blocks = [{"mode": b.mode.name, "alpha": b.alpha, "tier": b.tier.name, "keep": b.keep, "swap": b.swap,
               "recompute": b.recompute, "swap_bytes": b.swap_bytes, "forward_seconds": b.forward_seconds,
               "backward_seconds": b.backward_seconds, "params": b.params.name} for b in plan.blocks]
    return {"blocks": blocks, "lines": [plan.block_line(i) for i in range(len(blocks))], "summary": plan.summary(),
            "predicted_device_peak_bytes": plan.predicted_device_peak_bytes,
            "predicted_step_seconds": plan.predicted_step_seconds, "keep_all_step_seconds": plan.keep_all_step_seconds,
            "host_bytes": plan.host_bytes, "nvme_bytes": plan.nvme_bytes, "fits": plan.fits,
            "rest_params": plan.rest_params.name,
            # The saved tensors outside the blocks: kept on the device, or swapped by the model-level hook.
            "outside_kept": plan.outside_kept, "outside_tier": plan.outside_tier.name,  # gpu (kept), host, nvme
            "outside_bytes": plan.outside_bytes,
            "outside_swap_seconds": plan.outside_swap_seconds,
            # Their pinned host staging on the way to NVMe (outside_tier nvme), counted in host_bytes.
            "outside_staging_bytes": plan.outside_staging_bytes}


def plan(blocks: list, links: Any, budgets: Any, mode: Optional[str] = None) -> dict:
    """The planner's choice for profile blocks (dicts or BlockProfiles), links and budgets (dicts or structs), or
    with ``mode`` every block in that mode (keep, swap, split, recompute) with the planner's predictions."""
    profiles = [block_profile(b) if isinstance(b, dict) else b for b in blocks]
    args = (profiles, links_struct(links), budgets_struct(budgets))
    if mode is None:
        planned = _C.plan_activations(*args)
        return dict(plan_dict(planned), why=[], struct=planned)
    if mode not in _C.BlockMode.__members__:
        raise _C.ConfigError(f"block mode {mode!r}; accepted: {', '.join(_C.BlockMode.__members__)}")
    return plan_dict(_C.forced_plan(*args, _C.BlockMode.__members__[mode]))


__all__ = ["BLOCK_FIELDS", "LINK_FIELDS", "BUDGET_FIELDS", "block_profile", "budgets_struct", "fields_of",
           "links_struct", "plan", "plan_dict"]
