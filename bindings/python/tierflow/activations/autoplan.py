"""Measuring blocks and links, asking the planner, applying its plan (Note [Activation plans])."""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _C
from .._distributed import fsdp_unit_bytes, rank_shard_bytes
from .._links import measure_links
from .._report import write_json_atomic
from .blocks import find_blocks
from .plans import BUDGET_FIELDS, block_profile as profile_struct, fields_of, links_struct, plan as make_plan_dict
# The file format of `python -m tierflow plan`.
from .profile import BLOCK_FIELDS, LINK_FIELDS, PROFILE_FORMAT, PROFILE_VERSION
from .runner import BlockRunner
from .table import probe_table

def block_profile(runner: BlockRunner, traffic: Any = None) -> dict:
    """One profile block from a runner's recorded table and timings (tiering::BlockTable::record,
    tiering::measured_block_profile), with the optimizer's `traffic` inside it (tiering::optimizer_traffic; none by default)."""
    record = runner.table.core.record(_C.median_seconds(runner.forward_seconds))
    if runner.backward_seconds:
        record.backward_seconds = _C.median_seconds(runner.backward_seconds)
    record.parameter_bytes = sum(p.numel() * p.element_size() for p in runner.module.parameters())
    record.replayable = runner.replayable  # Note [Replay side effects]: a user's hook on it: keep or swap only
    return fields_of(_C.measured_block_profile(record, traffic or _C.OptimizerTraffic()), BLOCK_FIELDS)


class AutoPlanner:
    """TIERFLOW_OFFLOAD_ACTIVATIONS=auto and =recompute for one session (Note [Activation plans])."""

    def __init__(self, session: Any, model: torch.nn.Module, blocks: Optional[list] = None) -> None:
        self.session = session
        cfg = session.config
        self.forced = cfg["TIERFLOW_OFFLOAD_ACTIVATIONS"] == "recompute"
        modules = list(blocks) if blocks is not None else find_blocks(model)
        self.runners = [BlockRunner(session, m, i, self) for i, m in enumerate(modules)]
        self.model_params = [p for p in model.parameters()]
        self._model = weakref.ref(model)  # FSDP2 may shard it after wrap: its parameters are read when planning
        self.fsdp_gathered_bytes = 0  # tiering::fsdp_gathered_bytes at the last budgets()
        self.profile_path = cfg["TIERFLOW_PROFILE"]
        self.plan: Optional[dict] = None
        self.profile: Optional[dict] = None  # the one the plan was made from
        self.keep_all = False  # the plan keeps every block and what is saved outside them: no saved-tensor hooks
        self.outside_kept = False  # the plan keeps what is saved outside the blocks: no model-level hooks
        if not self.runners:
            _C.log("warn", "tierflow: no repeated blocks found in the model (pass blocks=[...] to tierflow.wrap); "
                   "TIERFLOW_OFFLOAD_ACTIVATIONS=" + cfg["TIERFLOW_OFFLOAD_ACTIVATIONS"] + (
                       " swaps every saved tensor to the host instead" if self.forced else
                       " swaps every saved tensor to the host in the first step, then keeps them all on the device "
                       "if what that step saved fits within TIERFLOW_GPU_MEMORY"))
        self.loaded_profile: Optional[dict] = None
        if not self.forced and self.profile_path and os.path.exists(self.profile_path):
            self.loaded_profile = load_profile(self.profile_path, len(self.runners))
        # Forwards' start times once a plan is in force: the measured step beside the predicted one.
        self._step_starts: list = []
        self._timed_start: Optional[float] = None  # the timed step's forward (Note [Re-plan]: the rest of a step)
        self.replanned: Optional[dict] = None  # Note [Re-plan]: the one re-plan, or why there was none
        self.timed_step: Optional[dict] = None  # what the timed step measured (report()["plan"]["timed_step"])
        self._plan_struct: Any = None  # the plan in force as tiering's Plan (what a re-plan calibrates on)
        # Note [Batch growth]: the profiling forwards' sizes (elements of the model's input tensors) by forward,
        # the size the plan in force is for (0: not tracked), and what larger batches did.
        self._inputs: dict = {}  # the profiling forwards' input tensors' elements (by place), by forward
        self._reference: dict = {}  # the profiled forward's, which a forward's size is measured against
        self._elements = 0  # this forward's size
        self._untracked_said = self._other_inputs_said = False
        self._beside_bytes = 0  # CUDA: the device's bytes beside the model's before the first forward
        self.planned_elements = 0
        self.batch_growth: dict = {"replans": 0, "refused": None}
        self._first_saved_bytes = 0  # without blocks: what the first step saved (plan_without_blocks)
        # CUDA, the timed step: the device's peak over forward and backward, and over the optimizer's step
        # (Note [Auto plan phases]); the global step pre-hook that splits them, while it is in place.
        self._forward_backward_peak: Optional[int] = None
        self._forward_backward_reserved: Optional[int] = None  # the caching allocator's, over the same span
        self.optimizer_step_peak: Optional[int] = None
        self._step_hook: Any = None
        # Note [Auto plan phases]: when to record, time and plan.
        self.phases = _C.AutoPlanPhases(forced=self.forced, blocks=bool(self.runners),
                                        loaded_profile=self.loaded_profile is not None,
                                        replan=_C.replans(dict(cfg)))

    @property
    def forwards(self) -> int:
        return self.phases.forwards

    def remove(self) -> None:
        self._end_step_hook()
        for r in self.runners:
            r.remove()

    def report(self) -> dict:
        """The plan in force (or the phase before it) and what the runners did."""
        out: dict = {"blocks": len(self.runners), "forced": "recompute" if self.forced else None,
                     "replays": sum(r.replays for r in self.runners),
                     "restored_ops": sum(r.restored_ops for r in self.runners),
                     "split_rows": sum(r.split_rows for r in self.runners),
                     # Note [Data-dependent blocks]: blocks that swap whole, and why.
                     "data_dependent": {r.index: r.dynamic for r in self.runners if r.dynamic is not None},
                     # Note [Replay side effects]: blocks whose forward was not replayed, and why (the last
                     # reason); the state replays restored (parameters and buffers by name) and how often.
                     "not_replayed": {r.index: r.not_replayed for r in self.runners if r.not_replayed is not None},
                     "replay_restored": {r.index: sorted(r.writes) for r in self.runners if r.writes},
                     "restoring_replays": sum(r.restores for r in self.runners)}
        if self.plan is not None:
            out.update(self.plan_in_force())
            out.update(self.measured_beside_predicted(out))
        else:
            out["summary"] = "recompute every block (forced)" if self.forced else \
                f"profiling ({self.forwards} forwards so far; the plan is made before the third)"
        return out

    # The plan's figures a report shows, in this order.
    _PLAN_FIELDS = (
        "summary",
        # What is saved outside the blocks: kept, or swapped by the model-level hooks (Note [Activation planner]);
        # the window the plan runs with (Note [Overlap window]).
        "outside_kept", "outside_bytes", "outside_swap_seconds", "window_bytes", "window_wanted_bytes",
        "predicted_device_peak_bytes",
        # The whole step: the blocks' part the plan prices and the rest the timed step measured (Note [Re-plan]).
        "predicted_step_seconds", "predicted_blocks_seconds", "rest_of_step_seconds",
        # CUDA: what the caching allocator gave back when the plan came in force (Note [Auto plan phases]).
        "released_cached_bytes",
        # Note [Batch growth]: the batch size (input elements) the plan is for, and the profile's.
        "batch_elements", "profiled_batch_elements",
        # Note [Re-plan]: why the steps' measurement may no longer re-plan (None: it still may, or it did).
        "settled")

    def plan_in_force(self) -> dict:
        """The plan in force as report() shows it."""
        blocks = self.plan["blocks"]
        out: dict = {k: self.plan.get(k) for k in self._PLAN_FIELDS}
        out["modes"] = [bp["mode"] for bp in blocks]
        out["alpha"] = [bp["alpha"] for bp in blocks]
        # Where each block's parameters live between uses, then the rest unit's (gpu: resident).
        out["params"] = [bp.get("params", "gpu") for bp in blocks]
        out["rest_params"] = self.plan.get("rest_params", "gpu")
        out["replanned"] = self.replanned
        out["timed_step"] = self.timed_step  # None for a plan read from a profile
        out["why"] = self.plan.get("why", [])
        out["fsdp_gathered_bytes"] = self.fsdp_gathered_bytes  # FSDP2's gathered copies, in the fixed bytes (0: none)
        out["batch_growth"] = dict(self.batch_growth)  # Note [Batch growth]: re-plans for larger batches
        if self.optimizer_step_peak is not None:  # CUDA: the timed step's optimizer step, apart
            out["measured_peaks"] = {"forward_backward_bytes": self._forward_backward_peak,
                                     "forward_backward_reserved_bytes": self._forward_backward_reserved,
                                     "optimizer_step_bytes": self.optimizer_step_peak}
        # Saved bytes of the blocks the plan keeps: they never pass through the offloader's counters.
        out["kept_bytes"] = sum(profile_struct(b).saved_bytes() for b, bp in zip(self.profile["blocks"], blocks)
                                if bp["mode"] == "keep") if self.profile else 0
        return out

    def measured_beside_predicted(self, plan: dict) -> dict:
        """The plan's predictions beside what the steps since it measured (tiering::measured_beside_predicted,
        Note [Auto plan phases]); the peak is the caching allocator's reserved one on CUDA
        (torch.cuda.max_memory_reserved, since the timed step reset it, or since a plan read from a profile)."""
        peak = int(torch.cuda.max_memory_reserved(self._device())) if self._cuda() else None
        allocated = int(torch.cuda.max_memory_allocated(self._device())) if self._cuda() else None
        predicted = plan.get("predicted_device_peak_bytes")
        m = _C.measured_beside_predicted(self._step_starts, peak, plan.get("predicted_step_seconds"), predicted)
        # The plan budgets allocated memory (Note [Auto plan phases]): its own ratio beside the reserved one's.
        return {"measured": {"step_seconds": m.step_seconds, "steps": m.steps, "device_peak_reserved_bytes": peak,
                             "device_peak_allocated_bytes": allocated},
                "step_vs_predicted": m.step_vs_predicted, "peak_vs_predicted": m.peak_vs_predicted,
                "allocated_peak_vs_predicted": allocated / predicted if allocated is not None and predicted else None}

    # The session calls this before every forward of the model (Note [Auto plan phases]) with the elements of
    # each tensor it is called with, its size's measure (Note [Batch growth]).
    def before_forward(self, inputs: Optional[dict] = None) -> None:
        action = self.phases.before_forward()
        for r in self.runners:  # Note [Hooks stand aside]: back after a forward without grad
            r.step_in()
        inputs = {k: int(n) for k, n in (inputs or {}).items()}
        if self.plan is None and self.forwards <= 3:  # the profiling forwards
            self._inputs[self.forwards] = inputs
            if self.forwards == 1 and self._cuda():
                self._beside_bytes = self._bytes_beside_model()
        self._act(action)  # a plan made here sets the reference
        self._elements = self._size(inputs)
        if not self._elements and not self._untracked_said and not self.forced:
            self._untracked_said = True
            _C.log("warn", "tierflow: the model is called with no tensor among its arguments that tierflow can count "
                   "(a batch in a dataclass?): a batch larger than the one the activation plan was made for is not "
                   "seen, and the plan may then exceed TIERFLOW_GPU_MEMORY (Note [Batch growth]); pass the tensors "
                   "as arguments, or keep one batch size")
        if self.plan is not None:  # the measured step: from one forward to the next
            self._step_starts = (self._step_starts + [time.perf_counter()])[-(_C.MEASURED_STEPS + 1):]
            grown = _C.grown_batch(self.planned_elements, self._elements)
            if grown and not self.forced:
                self.grow(grown)
            if self.phases.may_replan and _C.batch_varies(self.planned_elements, self._elements):
                self.settle("the batches' sizes vary (Note [Batch growth]): a step's time is not comparable with "
                            "the plan's prediction")
            if self.phases.may_replan:
                self.maybe_replan()

    def _size(self, inputs: dict) -> int:
        """This forward's size against the profiled forward's (tiering::batch_size), their tensors matched by place
        (Note [Batch growth]); other tensors than the profiled forward's are said once."""
        ref = self._reference
        common = [k for k in inputs if k in ref]
        if ref and inputs and (len(common) != len(ref) or len(common) != len(inputs)) and not self._other_inputs_said:
            self._other_inputs_said = True
            _C.log("warn", f"tierflow: the model is called with other tensors ({sorted(inputs)}) than in the forward "
                   f"its activation plan was profiled on ({sorted(ref)}): a batch's size is measured on those both "
                   "have, or on all of its elements when none (Note [Batch growth])")
        return _C.batch_size([ref[k] for k in common], [inputs[k] for k in common], sum(ref.values()),
                             sum(inputs.values()))

    def _bytes_beside_model(self) -> int:
        """CUDA, before the first forward: the device's allocated bytes other than the model's parameters and
        gradients (a frozen model beside, another's tensors), which do not grow with the batch."""
        seen, own = set(), 0
        for p in self.model_params:
            for t in (p, p.grad):
                t = getattr(t, "_local_tensor", t)  # an FSDP2 shard
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    key = t.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        own += t.untyped_storage().nbytes()
        return max(0, int(torch.cuda.memory_allocated(self._device())) - own)

    def grow(self, elements: int) -> None:
        """Note [Batch growth]: a forward larger than the plan in force is for: plan again for its size, before
        it runs, from the profile scaled to it; when nothing fits, the plan in force stays and says so."""
        ratio = elements / self.planned_elements
        refusal = _C.batch_growth_refusal(dict(self.session.config))
        if refusal:
            self.refuse_growth(elements, refusal)
            return
        _C.log("warn", f"tierflow: a batch of {elements} input elements, x{ratio:.3g} the {self.planned_elements} "
               "the activation plan in force was made for: planning again for it (Note [Batch growth])")
        try:
            if self.plan.get("blocks"):
                self.make_plan(self.profile, elements)
            else:
                self.plan_without_blocks(elements)
        except (_C.OutOfMemoryError, _C.ConfigError) as e:
            self.refuse_growth(elements, "no activation plan fits it: " + str(e))
            return
        self.batch_growth["replans"] += 1
        self.batch_growth["refused"] = None
        self._step_starts = self._step_starts[-1:]

    def refuse_growth(self, elements: int, why: str) -> None:
        """The plan in force stays for a larger batch than it was made for: said once per size (a larger one
        tries again) and in the report (Note [Batch growth])."""
        self.batch_growth["refused"] = {"batch_elements": elements, "why": why}
        self.planned_elements = elements
        if self.phases.may_replan:  # the steps from here are not the plan's size
            self.settle("a batch larger than the plan's, which stays (Note [Batch growth])")
        _C.log("warn", f"tierflow: a batch of {elements} input elements, larger than the "
               f"{self.plan.get('batch_elements')} the activation plan in force was made for, which stays and may "
               f"exceed TIERFLOW_GPU_MEMORY: {why}")

    def _act(self, action: Any) -> None:
        if action == _C.PhaseAction.plan_without_blocks:
            self.plan_without_blocks()
        elif action == _C.PhaseAction.plan_from_profile:
            # A profile file from before Note [Batch growth]: taken to be for this (the first) forward's size.
            profile = self.loaded_profile
            profile.setdefault("batch_tensor_elements", self._inputs.get(self.forwards, {}))
            self._reference = {k: int(n) for k, n in profile["batch_tensor_elements"].items()}
            profile["batch_elements"] = sum(self._reference.values())
            self.make_plan(profile, self._size(self._inputs.get(self.forwards, {})))
        elif action == _C.PhaseAction.start_timing:
            self._timed_start = time.perf_counter()
            self._policy_bytes = self._packed_outside()
            for r in self.runners:
                r.timing = True
            if self._cuda():
                torch.cuda.reset_peak_memory_stats(self._device())
                self._end_step_hook()  # a refused forward may have started the timing once already
                hook = weakref.WeakMethod(self._before_timed_step)  # the hook is global: it must not keep us
                self._step_hook = register_optimizer_step_pre_hook(
                    lambda *a: hook() and hook()(*a))
        elif action == _C.PhaseAction.measure_and_plan:
            for r in self.runners:
                r.timing = False
            self._end_step_hook()
            if self._cuda():
                # Forward and backward's peak (read when the optimizer's step began, else now): what the saved
                # activations meet. The step's own (an AdamW's temporaries) comes after they are gone.
                now = int(torch.cuda.max_memory_allocated(self._device()))
                if self._forward_backward_peak is None:
                    self._forward_backward_peak = now
                    self._forward_backward_reserved = int(torch.cuda.max_memory_reserved(self._device()))
                else:
                    self.optimizer_step_peak = now
            step = time.perf_counter() - self._timed_start if self._timed_start is not None else 0.0
            profile = self.measure()
            # Note [Batch growth]: the timed forward's size (its tables, times and peak), which later ones are
            # measured against.
            self._reference = self._inputs.get(2, {})
            profile["batch_tensor_elements"] = dict(self._reference)
            profile["batch_elements"] = sum(self._reference.values())
            # What the model-level hook packed in the timed step: the saved tensors outside the blocks (the runners
            # shield theirs; Note [Auto plan phases]).
            outside = self._packed_outside() - self._policy_bytes
            profile["outside_saved_bytes"] = outside
            # Less their round trip, which the timed step made and the plan adds back where it swaps them,
            # and less the host's own time between neighbouring blocks, the timing's (Note [Re-plan]).
            gaps = _C.host_gaps_seconds([(kind == "backward", r.index, t0, t1, wait) for r in self.runners
                                         for kind, t0, t1, wait in r.intervals])
            profile["host_gaps_seconds"] = gaps
            profile["timed_step_seconds"] = step
            profile["rest_of_step_seconds"] = _C.rest_of_step_seconds(step, sum(
                sum(r.forward_seconds) + sum(r.backward_seconds) + sum(r.recompute_seconds) for r in self.runners),
                _C.outside_swap_seconds(links_struct(profile["links"]), outside), gaps,
                sum(sum(r.input_swap_seconds) for r in self.runners))
            if self._forward_backward_peak is not None:
                profile["measured_beside_bytes"] = self._beside_bytes
                profile["measured_peak_bytes"] = self._forward_backward_peak
                profile["measured_reserved_peak_bytes"] = self._forward_backward_reserved
            profile["fixed_device_bytes"] = self.budgets(profile)["fixed_device_bytes"]
            self.timed_step = self._timed_step_summary(profile, step, gaps)
            if self.profile_path:
                write_json_atomic(self.profile_path, profile)
            self.make_plan(profile, max(self._size(n) for n in self._inputs.values()))

    def _timed_step_summary(self, profile: dict, step: float, gaps: float) -> dict:
        """What the timed step measured, as the report shows it: the figures the plan's predictions stand on, so
        that a run on a GPU says where a prediction went wrong (issue 17)."""
        runners = self.runners
        return {"step_seconds": step, "blocks_forward_seconds": sum(sum(r.forward_seconds) for r in runners),
                "blocks_backward_seconds": sum(sum(r.backward_seconds) for r in runners),
                "blocks_replay_seconds": sum(sum(r.recompute_seconds) for r in runners),
                "blocks_input_swap_seconds": sum(sum(r.input_swap_seconds) for r in runners),
                "host_gaps_seconds": gaps, "rest_of_step_seconds": profile["rest_of_step_seconds"],
                "outside_saved_bytes": profile.get("outside_saved_bytes"),
                "measured_peak_bytes": profile.get("measured_peak_bytes"),
                "fixed_device_bytes": profile.get("fixed_device_bytes"),
                "links": dict(profile["links"]),
                "blocks": [{k: b.get(k) for k in ("forward_seconds", "backward_seconds", "input_bytes", "whole_bytes",
                                                  "split_bytes", "cheap_bytes", "transient_bytes",
                                                  "split_recompute_seconds", "cheap_recompute_seconds")}
                           for b in profile["blocks"]]}

    def _packed_outside(self) -> int:
        return int(self.session.runtime.stats()["activations"]["policy_bytes"])

    def _before_timed_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """A global optimizer step pre-hook during the timed step: the device's peak so far is forward and
        backward's (Note [Auto plan phases]); the step's is counted from here. The hook is global: another
        model's optimizer (a GAN's other half) is not this model's step."""
        mine = {id(p) for p in self.model_params}
        if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            return
        if self._forward_backward_peak is None:
            self._forward_backward_peak = int(torch.cuda.max_memory_allocated(self._device()))
            self._forward_backward_reserved = int(torch.cuda.max_memory_reserved(self._device()))
            torch.cuda.reset_peak_memory_stats(self._device())

    def _end_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def plan_without_blocks(self, elements: int = 0) -> None:
        """No blocks to plan: keep every saved tensor when the first step's fit beside what training holds,
        else go on swapping them all (the first step swapped them, so it fit wherever anything fits); for a
        larger batch than the first, its saved bytes scaled alike (Note [Batch growth])."""
        if self.plan is None:
            self._first_saved_bytes = int(self.session.runtime.stats()["activations"]["offloaded_bytes"])
            self._reference = self._inputs.get(1, {})  # what the first step saved was its size's
            elements = self._size(self._inputs.get(self.forwards, {}))
        first = sum(self._reference.values())
        target = max(first, int(elements)) if first else 0
        saved = int(round(self._first_saved_bytes * (target / first if first else 1.0)))
        decided = _C.plan_without_blocks(saved, _C.Budgets(**self.budgets({"blocks": []})))
        self.planned_elements = target
        self.keep_all = self.outside_kept = decided.keep_all
        self.plan = {"summary": decided.summary, "blocks": [], "lines": [],
                     "predicted_device_peak_bytes": decided.predicted_device_peak_bytes,
                     "predicted_step_seconds": None,
                     # Without blocks everything saved is outside them.
                     "outside_kept": decided.keep_all, "outside_bytes": saved,
                     "window_bytes": int(self.session.config["TIERFLOW_PREFETCH_BYTES"]),
                     "batch_elements": target, "profiled_batch_elements": first}
        self.phases.planned()
        _C.log("warn", "tierflow activation plan: " + decided.summary)

    def measure(self) -> dict:
        rt = self.session.runtime
        device = self._device()
        links = measure_links(rt, device, shares=True)
        traffic = _C.optimizer_traffic(self.session.config)  # the same for every block
        if rt.has_nvme_tier:  # Note [NVMe probe]: through the engine, every path, O_DIRECT
            probe = _C.nvme_probe_bytes(int(rt.nvme_available_bytes()))
            while probe > 0:
                try:
                    links["nvme_write"], links["nvme_read"] = rt.measure_nvme(probe)
                    break
                except _C.OutOfMemoryError:  # the free space is in pieces: a smaller block
                    probe = _C.next_nvme_probe_bytes(probe)
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                "blocks": [block_profile(r, traffic) for r in self.runners], "links": links}

    def _cuda(self) -> bool:
        return self._device().type == "cuda"

    def _device(self) -> torch.device:
        return self.model_params[0].device if self.model_params else torch.device("cpu")

    def budgets(self, profile: dict) -> dict:
        """The planner's budgets for `profile` (tiering::session_budgets, Note [Auto plan phases])."""
        rt = self.session.runtime
        cfg = self.session.config
        pool = rt.stats().get("host_pool", {})
        model = self._model()
        # FSDP2: this rank's shards, and the units' gathered copies (tiering::fsdp_gathered_bytes).
        units, root = fsdp_unit_bytes(model) if model is not None else ([], 0)
        self.fsdp_gathered_bytes = _C.fsdp_gathered_bytes(units, root)  # in fixed_device_bytes; for the report
        inputs = _C.SessionBudgetInputs(
            device_budget_bytes=int(rt.device_budget_bytes()), host_budget_bytes=int(rt.host_budget_bytes()),
            # What is in use (optimizer states, saved tensors): slabs the pool reserved but holds nothing in (the
            # link probe's, for one) it releases when an allocation needs the room.
            host_in_use_bytes=int(pool.get("in_use", {}).get("current", 0)) if isinstance(pool, dict) else 0,
            nvme_available_bytes=int(rt.nvme_available_bytes()) if rt.has_nvme_tier else 0,
            prefetch_bytes=int(cfg["TIERFLOW_PREFETCH_BYTES"]),
            parameter_bytes=rank_shard_bytes(model) if model is not None else
            sum(p.numel() * p.element_size() for p in self.model_params),
            sharded_unit_bytes=units, sharded_root_bytes=root,
            optimizer_on_device=cfg["TIERFLOW_OFFLOAD_OPTIMIZER"] == "none",
            gradients_offloaded=cfg["TIERFLOW_OFFLOAD_GRADIENTS"] == "on",
            measured_peak_bytes=int(profile.get("measured_peak_bytes") or 0),
            measured_reserved_peak_bytes=int(profile.get("measured_reserved_peak_bytes") or 0),
            outside_saved_bytes=int(profile.get("outside_saved_bytes") or 0),
            batch_ratio=float(profile.get("batch_ratio") or 1.0),
            measured_beside_bytes=int(profile.get("measured_beside_bytes") or 0))
        params = self.session.params  # TIERFLOW_OFFLOAD_PARAMS=host: the plan counts the fetched parameters
        if params is not None:  # auto: which blocks keep theirs is the plan's (Note [Parameter hooks])
            inputs.params = _C.ParamPolicy.auto if params.planned else _C.ParamPolicy.fetch_all
            inputs.param_tier = _C.Tier.__members__[params.tier]
            inputs.rest_parameter_bytes = params.rest_bytes
            inputs.measured_parameter_peak_bytes = int(params.stats()["device_peak_bytes"])
        blocks = [profile_struct(b) for b in profile["blocks"]]
        return fields_of(_C.session_budgets(inputs, blocks), BUDGET_FIELDS)

    def settle(self, why: str) -> None:
        """The plan in force stays: device memory was taken after its measurements (``why``), which a re-plan's
        figures would not count (Note [Steady step])."""
        if self.phases.may_replan:
            self.phases.replan_settled()
            if self.plan is not None:
                self.plan["settled"] = why
            _C.log("info", "tierflow activation plan: no re-plan from here: " + why)

    def maybe_replan(self) -> None:
        """Note [Re-plan]: once the steps under the plan stray from its whole-step prediction, plan once more
        from the figures calibrated on them; or say once why not."""
        # The first step under a plan is left out: it pins the host memory the plan's swaps need.
        m = _C.measured_beside_predicted(self._step_starts[1:], None, self.plan.get("predicted_step_seconds"), None)
        if not _C.strays_from_prediction(m.step_seconds, m.steps, self.plan.get("predicted_step_seconds")):
            return
        self.phases.replan_settled()
        rest = float(self.plan.get("rest_of_step_seconds") or 0.0)
        blocks = [profile_struct(b) for b in self.plan_blocks]
        cal = _C.calibrate_figures(blocks, links_struct(self.profile["links"]),
                                   _C.Budgets(**self.budgets(self.profile)), self._plan_struct, m.step_seconds, rest)
        self.replanned = {"replanned": cal.calibrated, "why": cal.why, "measured_step_seconds": m.step_seconds,
                          "steps": m.steps, "predicted_step_seconds": self.plan["predicted_step_seconds"],
                          "link_factor": cal.link_factor, "compute_factor": cal.compute_factor}
        if not cal.calibrated:
            _C.log("info", "tierflow: no re-plan: " + cal.why)
            return
        profile = dict(self.profile, blocks=[fields_of(b, BLOCK_FIELDS) for b in cal.blocks],
                       links=fields_of(cal.links, LINK_FIELDS),
                       calibrated={"link_factor": cal.link_factor, "compute_factor": cal.compute_factor,
                                   "why": cal.why})
        _C.log("warn", "tierflow: re-planning once: " + cal.why)
        try:
            self.make_plan(profile)
        except (_C.OutOfMemoryError, _C.ConfigError) as e:  # the plan in force goes on: nothing was applied
            self.replanned.update(replanned=False, why=cal.why + "; the re-plan failed, the plan in force stays: "
                                  + str(e))
            _C.log("warn", "tierflow: " + self.replanned["why"])
            return
        if self.profile_path:  # the next run starts from the calibrated figures
            write_json_atomic(self.profile_path, profile)
        self._step_starts = self._step_starts[-1:]  # the steps under the new plan from here

    def for_batch(self, profile: dict, elements: int) -> tuple:
        """`profile` scaled to a batch of `elements` (Note [Batch growth]) and the size it is for: the profile's
        own size when it records none or `elements` is not larger."""
        base = int(profile.get("batch_elements") or 0)
        target = max(base, int(elements)) if base else 0
        if not base or target == base:
            return profile, base
        ratio = target / base
        blocks = _C.blocks_for_batch([profile_struct(b) for b in profile["blocks"]], ratio)
        return dict(profile, blocks=[fields_of(b, BLOCK_FIELDS) for b in blocks], batch_ratio=ratio,
                    outside_saved_bytes=int(round(int(profile.get("outside_saved_bytes") or 0) * ratio))), target

    def make_plan(self, base_profile: dict, elements: int = 0) -> None:
        """Plans from `base_profile` for a batch of `elements` (Note [Batch growth]: the profile's own size when
        that is larger or not known)."""
        profile, target = self.for_batch(base_profile, elements)
        budgets = self.budgets(profile)
        blocks = [dict(b) for b in profile["blocks"]]
        plan = make_plan_dict(blocks, profile["links"], budgets, explain=True)
        # A split is exact only where the suffix matmul gives the full one's bits (Note [Activation plans]).
        unsplittable = self.probe(plan)
        if unsplittable:
            for i in unsplittable:
                blocks[i]["splittable"] = False
            plan = make_plan_dict(blocks, profile["links"], budgets, explain=True)
            self.probe(plan)
        self._plan_struct = plan.pop("struct")
        self.plan_blocks = blocks  # the profile's blocks as planned (split ones that probed inexact marked so)
        # Note [Overlap window]: no block's swap waits inside its compute, as far as the device budget allows.
        window = _C.plan_window(self._plan_struct, _C.Budgets(**budgets),
                                int(self.session.config["TIERFLOW_PREFETCH_BYTES"]))
        self.session.runtime.set_activation_window(window.bytes)
        plan["window_bytes"], plan["window_wanted_bytes"] = window.bytes, window.wanted_bytes
        plan["predicted_device_peak_bytes"] = window.peak_bytes
        # The whole step predicted: the blocks' part priced by the plan, and the rest measured (Note [Re-plan]).
        plan["predicted_blocks_seconds"] = plan["predicted_step_seconds"]
        plan["rest_of_step_seconds"] = float(profile.get("rest_of_step_seconds") or 0.0)
        plan["predicted_step_seconds"] += plan["rest_of_step_seconds"]
        # A profile written before the tensors outside the blocks were measured: they stay as they were planned
        # then, swapped by the model-level hooks unless every block is kept.
        plan["outside_measured"] = "outside_saved_bytes" in profile
        self.apply(plan)
        if self.session.params is not None and self.session.params.planned:
            self.session.params.plan_residences(plan)
        if self._device().type == "cuda":  # Note [Auto plan phases]: the profiling's cached blocks go back
            reserved = torch.cuda.memory_reserved(self._device())
            torch.cuda.empty_cache()
            plan["released_cached_bytes"] = reserved - torch.cuda.memory_reserved(self._device())
        plan["batch_elements"] = target
        plan["profiled_batch_elements"] = int(base_profile.get("batch_elements") or 0)
        self.plan = plan
        self.phases.planned()
        self.profile = base_profile
        self.planned_elements = target
        if profile is not base_profile and self.phases.may_replan:
            # The calibration compares steps with the timed one: not with a plan for another size.
            self.settle("the plan is for a larger batch than the profile's (Note [Batch growth])")
        _C.log("warn", "tierflow activation plan: " + plan["summary"])
        for line in plan["lines"]:
            _C.log("info", "tierflow   " + line)
        for line in plan["why"]:  # what each rejected action would have cost (Note [Plan report])
            _C.log("info", "tierflow " + line)

    def probe(self, plan: dict) -> list:
        """Sets each split block's exact first rows; returns the blocks where no split op is exact."""
        failed = []
        for i, (r, bp) in enumerate(zip(self.runners, plan["blocks"])):
            # Without a table yet (a profile read from a file) the runner probes once it has recorded one.
            if bp["mode"] == "split" and r.table is not None and not probe_table(r.table, bp["alpha"]):
                failed.append(i)
        return failed

    def apply(self, plan: dict) -> None:
        for r, bp in zip(self.runners, plan["blocks"]):
            if (r.mode, r.alpha) != (bp["mode"], bp["alpha"]):
                # Only the last forward's table was probed for this plan's split (probe): the other shapes' go,
                # and record again when met (Note [Batch growth]).
                r.tables = {k: t for k, t in r.tables.items() if t is r.table}
            r.mode = bp["mode"]
            r.alpha = bp["alpha"]
            r.tier = bp["tier"]
        # What is saved outside the blocks: kept (the session puts no hooks on the model) or swapped by the
        # model-level hooks (Note [Activation planner], Outside the blocks).
        all_kept = all(bp["mode"] == "keep" for bp in plan["blocks"])
        self.outside_kept = plan.get("outside_kept", True) if plan.get("outside_measured", True) else all_kept
        self.keep_all = self.outside_kept and all_kept
        # A plan that keeps everything leaves no hook on any block (the session puts none on the model either);
        # a later plan that moves something puts them back. In a mixed plan a kept block keeps its hooks: they
        # shield its saved tensors from the model-level hooks that offload the rest.
        for r in self.runners:
            if self.keep_all:
                r.remove()
            else:
                r.install()


def load_profile(path: str, blocks: int) -> dict:
    """A profile written by a previous run (TIERFLOW_PROFILE); errors name what is wrong, the file stays
    (tiering::profile_for_model, Note [Profile file])."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, ValueError) as e:
        raise _C.ConfigError(_C.not_a_profile(path, str(e))) from e
    _C.profile_for_model(path, text, blocks)
    try:
        profile = json.loads(text)  # as written: a block without backward_seconds gets the planner's estimate
    except (ValueError, RecursionError) as e:
        raise _C.ConfigError(_C.not_a_profile(path, str(e))) from e
    profile.setdefault("links", {})
    return profile
