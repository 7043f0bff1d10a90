"""The front end of tiering::PlanDriver: measuring blocks and links and applying the plans it decides
(Note [Plan driver], Note [Activation plans])."""

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
from .plans import BUDGET_FIELDS, fields_of, links_struct
from .runner import BlockRunner
from .table import probe_table

# Note [Step prediction]: TimedStepMeasures (the driver's, in _C) gets the CPU optimizer's fields from the
# torch-free module that binds the prediction.
_C.add_timed_step_optimizer_fields(_C.TimedStepMeasures)

def block_record(runner: BlockRunner) -> Any:
    """A runner's recorded table and timings (tiering::BlockTable::record); the driver prices it
    (tiering::measured_block_profile, with the optimizer's traffic)."""
    record = runner.table.core.record(_C.median_seconds(runner.forward_seconds))
    if runner.backward_seconds:
        record.backward_seconds = _C.median_seconds(runner.backward_seconds)
    record.parameter_bytes = sum(p.numel() * p.element_size() for p in runner.module.parameters())
    record.replayable = runner.replayable  # Note [Replay side effects]: a user's hook on it: keep or swap only
    return record


def measured_compute(plan: dict, replays: list) -> tuple:
    """The blocks' compute as the timed step measured it, with the replays the plan in force does, and what it is
    over (tiering::measured_compute; `replays`: each block's measured replay seconds, None where none was)."""
    return _C.measured_compute(json.dumps(plan), replays)


def counters_struct(counters: dict) -> Any:
    """tiering::WaitCounters from _wait_counters' dict (a key it lacks, or None: the struct's default)."""
    return _C.WaitCounters(**{k: v for k, v in counters.items() if v is not None})


# The report's parts the measured terms read (tiering::measured_terms_json).
_MEASURED_FROM = ("timed_step", "modes", "alpha", "batch_elements", "profiled_batch_elements", "measured")


class AutoPlanner(_C.PlanFrontEnd):
    """TIERFLOW_OFFLOAD_ACTIVATIONS=auto and =recompute for one session: tiering::PlanDriver decides, this measures
    and applies (Note [Plan driver])."""

    def __init__(self, session: Any, model: torch.nn.Module, blocks: Optional[list] = None) -> None:
        super().__init__()
        self.session = session
        cfg = session.settings  # typed (Note [Typed settings])
        modules = list(blocks) if blocks is not None else find_blocks(model)
        self.runners = [BlockRunner(session, m, i, self) for i, m in enumerate(modules)]
        self.model_params = [p for p in model.parameters()]
        self._model = weakref.ref(model)  # FSDP2 may shard it after wrap: its parameters are read when planning
        self.profile_path = cfg.profile
        settings = _C.PlanDriverSettings(cfg, len(self.runners))
        self.forced = settings.forced
        self._loaded: Optional[dict] = None  # the profile file as read: its other keys are written back
        if not self.forced and self.profile_path and os.path.exists(self.profile_path):
            self._loaded = load_profile(self.profile_path, len(self.runners))
        self.driver = _C.PlanDriver(settings, auto_profile(self._loaded) if self._loaded is not None else None)
        self.phases = self.driver  # forwards, may_replan, forward_refused (Note [Auto plan phases])
        self.plan: Optional[dict] = None  # the plan in force as the report and the session read it
        self._revision = 0  # the driver's plan this copy is of
        self.keep_all = False  # the plan keeps every block and what is saved outside them: no saved-tensor hooks
        self.outside_kept = False  # the plan keeps what is saved outside the blocks: no model-level hooks
        self.outside_tier = "host"  # where the model-level hooks send them: gpu (kept), host or nvme
        self._beside_bytes = 0  # CUDA: the device's bytes beside the model's before the first forward
        self._policy_bytes = 0  # what the model-level hook had packed when the timed step began
        # CUDA, the timed step: the device's peak over forward and backward, and over the optimizer's step
        # (Note [Auto plan phases]); the global step pre-hook that splits them, while it is in place.
        self._forward_backward_peak: Optional[int] = None
        self._forward_backward_reserved: Optional[int] = None  # the caching allocator's, over the same span
        self.optimizer_step_peak: Optional[int] = None
        self._step_hook: Any = None
        # Note [Step prediction]: the counters when the timed step began and when the plan in force came in.
        self._timed_counters: dict = {}
        self._plan_counters: dict = {}

    @property
    def forwards(self) -> int:
        return self.driver.forwards

    @property
    def profile(self) -> Optional[dict]:
        """The profile the plan in force was made from, as its file holds it."""
        p = self.driver.profile
        return self._profile_dict(p) if p is not None else None

    def remove(self) -> None:
        self._end_step_hook()
        for r in self.runners:
            r.remove()

    # The session calls this before every forward of the model (Note [Auto plan phases]) with the elements of
    # each tensor it is called with, its size's measure (Note [Batch growth]).
    def before_forward(self, inputs: Optional[dict] = None) -> None:
        if self.plan is None and self.driver.forwards == 0 and self._cuda():
            self._beside_bytes = self._bytes_beside_model()
        for r in self.runners:  # Note [Hooks stand aside]: back after a forward without grad
            r.step_in()
        self.driver.before_forward([(k, int(n)) for k, n in (inputs or {}).items()], self)
        self._sync(forward_counted=True)

    def settle(self, why: str) -> None:
        """The plan in force stays: device memory was taken after its measurements (``why``), which a re-plan's
        figures would not count (Note [Steady step])."""
        self.driver.settle(why)
        self._sync()

    def budgets(self, profile: dict) -> dict:
        """The planner's budgets for `profile` (tiering::session_budgets, Note [Auto plan phases])."""
        return fields_of(self.driver.budgets(auto_profile(profile), self), BUDGET_FIELDS)

    def _sync(self, forward_counted: bool = False) -> None:
        """This copy of the driver's plan, when it changed. `forward_counted`: before a forward the driver counted
        already, which runs under the plan: its waits come after the counters read here, so it is not among their
        forwards done (Note [Step prediction]: a term's waits and the forwards they are divided by, the same ones)."""
        if self.driver.revision == self._revision:
            return
        self._revision = self.driver.revision
        d = self.driver.plan
        self.plan = json.loads(_C.plan_json(d))
        self.keep_all, self.outside_kept = d.keep_all, d.outside_kept
        self.outside_tier = self.plan.get("outside_tier", "gpu" if d.outside_kept else "host")
        self._plan_counters = self._wait_counters()
        if forward_counted:
            self._plan_counters["forwards"] -= 1

    def _profile_dict(self, p: Any) -> dict:
        """An AutoProfile as its file holds it (Note [Profile file]); a file read back keeps its other keys."""
        return dict(self._loaded or {}, **json.loads(_C.auto_profile_json(p)))

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
            # The plan's figures, the re-plan, the timed step, batch growth (tiering::PlanDriver::report_json): the
            # driver's plan, else one given by hand.
            out.update(json.loads(self.driver.report_json("{}" if self.driver.plan else json.dumps(self.plan))))
            if self.optimizer_step_peak is not None:  # CUDA: the timed step's optimizer step, apart
                out["measured_peaks"] = {"forward_backward_bytes": self._forward_backward_peak,
                                         "forward_backward_reserved_bytes": self._forward_backward_reserved,
                                         "optimizer_step_bytes": self.optimizer_step_peak}
            out.update(self.measured_beside_predicted(out))
            self._measured_terms(out)
        else:
            out["summary"] = "recompute every block (forced)" if self.forced else \
                f"profiling ({self.forwards} forwards so far; the plan is made before the third)"
        return out

    def measured_beside_predicted(self, plan: dict) -> dict:
        """The plan's predictions beside what the steps since it measured (tiering::measured_beside_predicted,
        Note [Auto plan phases]); the peak is the caching allocator's reserved one on CUDA
        (torch.cuda.max_memory_reserved, since the timed step reset it, or since a plan read from a profile)."""
        peak = int(torch.cuda.max_memory_reserved(self._device())) if self._cuda() else None
        allocated = int(torch.cuda.max_memory_allocated(self._device())) if self._cuda() else None
        # The plan budgets allocated memory (Note [Auto plan phases]): its own ratio beside the reserved one's.
        return json.loads(self.driver.measured_beside_predicted_json(peak, allocated,
                                                                     plan.get("predicted_device_peak_bytes")))

    # --- the whole step, term by term (Note [Step prediction]) ---

    def _stream_stats(self) -> dict:
        """The CPU AdamW's gradient stream's counters (empty without one)."""
        opt = self.session.optimizer() if self.session.optimizer is not None else None
        return opt.stream_stats() if hasattr(opt, "stream_stats") else {}

    def _wait_counters(self) -> dict:
        """What the runtime counts of the step's waits, cumulative: the forwards so far (one a step), the compute's
        waits for activations coming back and for the copy window, step()'s wait for the CPU optimizer, the CPU
        optimizer's worker's wait for gradient copies after backward ended, and its kernel's time and gradient
        bytes."""
        stats = self.session.runtime.stats()
        stream = self._stream_stats()
        opt = self.session.optimizer() if self.session.optimizer is not None else None
        python_ns = getattr(opt, "python_step_ns", None)  # a CPUAdamW's Python path inside step()
        hooks = getattr(self.session, "step_stats", None)  # Note [Step stats]: the optimizer steps so far
        params = self.session.params.stats() if getattr(self.session, "params", None) is not None else {}
        return {"forwards": self.driver.forwards,
                "optimizer_steps": hooks.recorder.recorded if hooks is not None and hooks.recorder.ends_at_step
                else self.driver.forwards,
                "param_wait_ms": float(params.get("stall_ms", 0.0)) if params else None,
                "activation_wait_ms": float(stats.get("prefetch", {}).get("stall_ms", 0.0)) +
                float(stats.get("activations", {}).get("offload_wait_ms", 0.0)),
                "step_wait_ms": float(stream.get("step_wait_ms", 0.0)),
                "grad_copy_wait_ms": float(stream.get("grad_copy_wait_ms", 0.0)),
                "kernel_ms": float(stream.get("kernel_ms", 0.0)) + float(stream.get("step_kernel_ms", 0.0)),
                "kernel_grad_bytes": int(stream.get("kernel_grad_bytes", 0)), "streaming": bool(stream),
                "python_step_ms": python_ns / 1e6 if python_ns is not None else None,
                # the parameters the runtime's CPU Adam kernels stepped (the Python path's)
                "adam_elements": int(stats.get("optimizer", {}).get("elements", 0))}

    def _optimizer_inputs(self, before: dict, after: dict) -> Any:
        """The CPU optimizer as the timed step measured it (tiering::timed_optimizer_inputs): its parameters and
        its kernel's rate, stepping during backward; without a gradient stream a CPUAdamW steps all in step(), at
        the rate its Python path stepped."""
        params = [p for p in self.model_params if p.requires_grad]
        return _C.timed_optimizer_inputs(counters_struct(before), counters_struct(after),
                                         sum(p.numel() for p in params), params[0].element_size() if params else 4,
                                         str(self.session.settings.optimizer_states))

    def _measured_terms(self, out: dict) -> None:
        """Each term's measurement beside its prediction (report()["plan"]["terms"], tiering::measured_terms_json):
        per step since the plan came in force, what the runtime counted; the blocks' compute as the timed step
        measured it; None where nothing measures it apart."""
        terms = out.get("terms")
        if not isinstance(terms, dict):
            return
        then = self._plan_counters
        replays = [sum(r.recompute_seconds) if r.recompute_seconds else None for r in getattr(self, "runners", [])]
        m = json.loads(_C.measured_terms_json(json.dumps({k: out.get(k) for k in _MEASURED_FROM}), replays,
                                              counters_struct(self._wait_counters()),
                                              counters_struct(then) if then else None))
        for name, term in terms.items():
            term["measured_s"] = m["measured"].get(name)
        out["terms_measured_over"] = m["over"]

    # --- what the driver asks of its front end (tiering::PlanFrontEnd) ---

    def budget_inputs(self) -> Any:
        """The budgets' inputs measured now: the runtime's room, the model's parameters (FSDP2: this rank's
        shards and the units' gathered sizes), the fetched parameters' policy (tiering::SessionBudgetInputs)."""
        rt = self.session.runtime
        pool = rt.stats().get("host_pool", {})
        model = self._model()
        units, root = fsdp_unit_bytes(model) if model is not None else ([], 0)
        inputs = _C.SessionBudgetInputs(
            device_budget_bytes=int(rt.device_budget_bytes()), host_budget_bytes=int(rt.host_budget_bytes()),
            # What is in use (optimizer states, saved tensors): slabs the pool reserved but holds nothing in (the
            # link probe's, for one) it releases when an allocation needs the room.
            host_in_use_bytes=int(pool.get("in_use", {}).get("current", 0)) if isinstance(pool, dict) else 0,
            nvme_available_bytes=int(rt.nvme_available_bytes()) if rt.has_nvme_tier else 0,
            parameter_bytes=rank_shard_bytes(model) if model is not None else
            sum(p.numel() * p.element_size() for p in self.model_params),
            sharded_unit_bytes=units, sharded_root_bytes=root)
        params = self.session.params  # TIERFLOW_OFFLOAD_PARAMS=host: the plan counts the fetched parameters
        if params is not None:  # auto: which blocks keep theirs is the plan's (Note [Parameter hooks])
            inputs.params = _C.ParamPolicy.auto if params.planned else _C.ParamPolicy.fetch_all
            inputs.param_tier = _C.Tier.__members__[params.tier]
            inputs.rest_parameter_bytes = params.rest_bytes
            inputs.measured_parameter_peak_bytes = int(params.stats()["device_peak_bytes"])
        return inputs

    def inexact_splits(self, blocks: list) -> list:
        return self.probe({"blocks": [{"mode": b.mode.name, "alpha": b.alpha} for b in blocks]})

    def apply_plan(self, d: Any) -> Optional[int]:
        """Puts the driver's plan in force; on CUDA the profiling's cached blocks go back (Note [Auto plan
        phases]): returns how many bytes."""
        plan = json.loads(_C.plan_json(d))
        self.session.runtime.set_activation_window(d.window_bytes)  # Note [Overlap window]
        self.apply(plan, d.keep_all, d.outside_kept)
        if self.session.params is not None and self.session.params.planned:
            self.session.params.plan_residences(plan)
        if self._device().type != "cuda":
            return None
        reserved = torch.cuda.memory_reserved(self._device())
        torch.cuda.empty_cache()
        return reserved - torch.cuda.memory_reserved(self._device())

    def start_timing(self) -> None:
        self._policy_bytes = self._packed_outside()
        self._timed_counters = self._wait_counters()
        for r in self.runners:
            r.timing = True
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(self._device())
            self._end_step_hook()  # a refused forward may have started the timing once already
            hook = weakref.WeakMethod(self._before_timed_step)  # the hook is global: it must not keep us
            self._step_hook = register_optimizer_step_pre_hook(lambda *a: hook() and hook()(*a))

    def measure_timed_step(self) -> Any:
        """What the timed step measured; the links and the NVMe tier are probed here (Note [Auto plan phases])."""
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
        links = self.measure_links()
        runners = self.runners
        m = _C.TimedStepMeasures(
            blocks=[block_record(r) for r in runners], links=links_struct(links),
            # What the model-level hook packed in the timed step: the saved tensors outside the blocks (the runners
            # shield theirs).
            outside_saved_bytes=max(0, self._packed_outside() - self._policy_bytes),
            intervals=[(kind == "backward", r.index, t0, t1, wait) for r in runners
                       for kind, t0, t1, wait in r.intervals],
            blocks_forward_seconds=sum(sum(r.forward_seconds) for r in runners),
            blocks_backward_seconds=sum(sum(r.backward_seconds) for r in runners),
            blocks_replay_seconds=sum(sum(r.recompute_seconds) for r in runners),
            blocks_input_swap_seconds=sum(sum(r.input_swap_seconds) for r in runners),
            beside_bytes=self._beside_bytes)
        # Note [Activation planner], Outside the blocks: the largest of them, their host staging on the way to NVMe
        # (Budgets::outside_largest_bytes).
        m.outside_largest_bytes = int(self.session.runtime.stats()["activations"].get("policy_largest_bytes", 0))
        if self._forward_backward_peak is not None:
            m.peak_bytes, m.reserved_peak_bytes = self._forward_backward_peak, self._forward_backward_reserved
        # Note [Step prediction]: step()'s wait for the CPU optimizer in the timed step, and its kernel's rate.
        after = self._wait_counters()
        m.optimizer_wait_seconds = _C.timed_optimizer_wait_seconds(counters_struct(self._timed_counters),
                                                                   counters_struct(after))
        m.optimizer = self._optimizer_inputs(self._timed_counters, after)
        return m

    def now_seconds(self) -> float:
        return time.perf_counter()

    def first_step_saved_bytes(self) -> int:
        return int(self.session.runtime.stats()["activations"]["offloaded_bytes"])

    def write_profile(self, p: Any) -> None:
        if self.profile_path:
            write_json_atomic(self.profile_path, self._profile_dict(p))

    # --- measuring and applying ---

    def measure_links(self) -> dict:
        """The links, and the NVMe tier through its engine (Note [NVMe probe]: every path, O_DIRECT)."""
        rt = self.session.runtime
        links = measure_links(rt, self._device(), shares=True)
        if rt.has_nvme_tier:
            probe = _C.nvme_probe_bytes(int(rt.nvme_available_bytes()))
            while probe > 0:
                try:
                    links["nvme_write"], links["nvme_read"] = rt.measure_nvme(probe)
                    break
                except _C.OutOfMemoryError:  # the free space is in pieces: a smaller block
                    probe = _C.next_nvme_probe_bytes(probe)
        return links

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

    def _cuda(self) -> bool:
        return self._device().type == "cuda"

    def _device(self) -> torch.device:
        return self.model_params[0].device if self.model_params else torch.device("cpu")

    def probe(self, plan: dict) -> list:
        """Sets each split block's exact first rows; returns the blocks where no split op is exact."""
        failed = []
        for i, (r, bp) in enumerate(zip(self.runners, plan["blocks"])):
            # Without a table yet (a profile read from a file) the runner probes once it has recorded one.
            if bp["mode"] == "split" and r.table is not None and not probe_table(r.table, bp["alpha"]):
                failed.append(i)
        return failed

    def apply(self, plan: dict, keep_all: Optional[bool] = None, outside_kept: Optional[bool] = None) -> None:
        """Each runner's mode, alpha and tier from `plan`, and the hooks: none on a block when the plan keeps
        everything (`keep_all`), none on the model when it keeps what is saved outside the blocks (`outside_kept`;
        a plan given by hand without them keeps that unless it says)."""
        for r, bp in zip(self.runners, plan["blocks"]):
            if (r.mode, r.alpha) != (bp["mode"], bp["alpha"]):
                # Only the last forward's table was probed for this plan's split (probe): the other shapes' go,
                # and record again when met (Note [Batch growth]).
                r.tables = {k: t for k, t in r.tables.items() if t is r.table}
            r.mode = bp["mode"]
            r.alpha = bp["alpha"]
            r.tier = bp["tier"]
        if keep_all is None:
            outside_kept = plan.get("outside_kept", True)
            keep_all = outside_kept and all(bp["mode"] == "keep" for bp in plan["blocks"])
        self.keep_all, self.outside_kept = keep_all, outside_kept
        self.outside_tier = plan.get("outside_tier", "gpu" if outside_kept else "host")
        # A plan that keeps everything leaves no hook on any block (the session puts none on the model either);
        # a later plan that moves something puts them back. In a mixed plan a kept block keeps its hooks: they
        # shield its saved tensors from the model-level hooks that offload the rest.
        for r in self.runners:
            if self.keep_all:
                r.remove()
            else:
                r.install()


def auto_profile(profile: dict) -> Any:
    """tiering::AutoProfile from a profile's dict (a file's, or the driver's as profile gives it;
    tiering::auto_profile_from_json)."""
    return _C.auto_profile_from_json(json.dumps(profile))


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
