"""The reporting half of benchmarks/bench_gpu_offload.py: tierflow's report per measured step, the
gradient stream's figures, the losses' agreement with the baseline and the table printed at the end."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any, Optional

try:
    from tierflow._report import fmt_bytes, write_json_atomic  # noqa: E402
except ImportError as _e:  # tierflow._C missing or mid-rebuild: the torch modes still run, tierflow's fail
    _TIERFLOW_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

    def write_json_atomic(path: str, obj: Any) -> None:
        """tierflow._report.write_json_atomic's fallback: a reader never sees a half-written file."""
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tierflow-", suffix=".json.tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(obj, f, indent=2)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def fmt_bytes(n: float) -> str:
        return f"{n / (1 << 20):.2f} MiB"
else:
    _TIERFLOW_IMPORT_ERROR = None

GiB = 1 << 30
EMULATED_PEAK_NOTE = ("no device allocator on the CPU (emulated device): see saved_activations_device_peak_bytes "
                      "and host_peak_rss_bytes")


def parse_bytes(text: Any) -> Optional[int]:
    """'16GiB', '256KiB', '4MiB' or a plain number of bytes (None stays None)."""
    if text is None:
        return None
    t = str(text).strip()
    for suffix, scale in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40)):
        if t.endswith(suffix):
            return int(float(t[:-len(suffix)]) * scale)
    return int(t)


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _get(d: dict, path: str) -> Any:
    for k in path.split("."):
        d = d[k]
    return d


# Counters of tierflow's report, given per measured step (after minus before the measured steps).
_PER_STEP_COUNTERS = [
    "links.gpu_to_host_bytes", "links.host_to_gpu_bytes", "links.gpu_to_host_ops", "links.host_to_gpu_ops",
    "activations.packs", "activations.offloaded_blocks", "activations.offloaded_bytes",
    "activations.offload_waits", "activations.offload_wait_ms", "activations.host_fallbacks",
    "activations.kept_small", "activations.dedup_hits",
    "activations.nvme.writes", "activations.nvme.write_bytes", "activations.nvme.reads",
    "activations.nvme.forwarded", "activations.nvme.staging_waits", "activations.nvme.write_failures",
    "prefetch.prefetched_blocks", "prefetch.hits", "prefetch.forwarded", "prefetch.stalls", "prefetch.stall_ms",
    "prefetch.unprefetched", "optimizer.steps", "optimizer.step_ms",
]
# Peaks over the measured steps (the runtime's peaks are reset when they begin; the pool's are not).
_PEAKS = ["activations.device_bytes.peak", "activations.host_bytes.peak", "host_pool.in_use.peak",
          "host_pool.reserved.peak"]


def tierflow_summary(before: dict, after: dict, steps: int) -> dict:
    """The useful subset of tierflow's report: per-step traffic, prefetch and optimizer figures, peaks."""
    per_step = {}
    for path in _PER_STEP_COUNTERS:
        try:
            per_step[path] = (_get(after, path) - _get(before, path)) / steps
        except (KeyError, TypeError):
            per_step[path] = None
    peaks = {}
    for path in _PEAKS:
        try:
            peaks[path] = _get(after, path)
        except (KeyError, TypeError):
            peaks[path] = None
    return {"per_measured_step": per_step, "peaks": peaks,
            "overlap": dict(after.get("optimizer", {}).get("overlap") or {}),
            "note": "per_measured_step: report counters after minus before the measured steps, divided by "
                    "their number; activation peaks cover the measured steps, host pool peaks the whole run"}


def stream_summary(before: dict, after: dict, steps: int) -> dict:
    """tierflow-host-opt's gradient stream per measured step: CPU kernel time during backward and in
    step(), step()'s wait for the CPU, the weights' wait, bytes each way (Note [Gradient streaming])."""
    a = after.get("optimizer", {}).get("streaming") or {}
    b = before.get("optimizer", {}).get("streaming") or {}
    if not a:
        return {}

    def per_step(key: str, scale: float = 1.0) -> float:
        return (a.get(key, 0) - b.get(key, 0)) / steps * scale

    return {"streamed_kernel_seconds": per_step("kernel_ms", 1e-3),
            "step_kernel_seconds": per_step("step_kernel_ms", 1e-3),
            "step_wait_for_cpu_seconds": per_step("step_wait_ms", 1e-3),
            "weight_wait_seconds": per_step("weight_wait_ms", 1e-3),
            "grad_bytes_to_host_per_step": per_step("grad_bytes_to_host"),
            "weight_bytes_to_device_per_step": per_step("weight_bytes_to_device"),
            "grad_buckets_per_step": per_step("buckets"),
            "grad_bytes_freed_before_step_per_step": per_step("grad_bytes_freed"),
            "grad_bucket_bytes": a.get("bucket_bytes"), "grad_bucket_count": a.get("bucket_count"),
            "gpu_optimizer_fraction": a.get("gpu_optimizer_fraction"),
            "stream_window": window_summary(a.get("last_window") or {}),
            "stream_counters": a}


def window_summary(window: dict) -> dict:
    """Where the last window's time went on the optimizer's worker (Note [Stream timeline]), in ms from the
    window's first gradient: the kernel, waiting for copies, idle with nothing to step, and when it was done."""
    buckets = window.get("buckets") or []
    done = [b for b in buckets if b["stepped_ms"] >= 0]
    if not done:
        return {}
    kernel = sum(b["stepped_ms"] - b["landed_ms"] for b in done)
    copy_wait = sum(b["landed_ms"] - b["picked_ms"] for b in done)
    idle, free_at = 0.0, done[0]["launched_ms"]
    for b in done:
        idle += max(0.0, b["picked_ms"] - free_at)
        free_at = b["stepped_ms"]
    return {"buckets": len(buckets), "kernel_ms": kernel, "copy_wait_ms": copy_wait, "idle_ms": idle,
            "first_launched_ms": done[0]["launched_ms"], "first_landed_ms": done[0]["landed_ms"],
            "last_stepped_ms": done[-1]["stepped_ms"], "backward_end_ms": window.get("backward_end_ms"),
            "step_ms": window.get("step_ms"), "worker_done_ms": window.get("worker_done_ms")}


def loss_agreement(base: list[float], other: list[float]) -> dict:
    """How far a mode's losses are from the baseline's, step by step."""
    n = min(len(base), len(other))
    if n == 0:
        return {"steps_compared": 0}
    diffs = [abs(a - b) for a, b in zip(base[:n], other[:n])]
    return {"steps_compared": n, "first_step_bit_identical": base[0] == other[0],
            "all_steps_bit_identical": diffs == [0.0] * n and len(base) == len(other),
            "max_abs_diff": max(diffs), "max_rel_diff": max(d / abs(b) if b else d for d, b in zip(diffs, base)),
            "abs_diff_per_step": diffs}


PREDICTION_NOTE = ("the planner prices the repeated blocks' forward and backward (Note [Activation planner], "
                   "predicted_blocks_seconds, set beside the measured forward + backward: compute_vs_predicted) and "
                   "adds the rest of the step the timed step measured (Note [Re-plan]): predicted_step_seconds, set "
                   "beside the whole step (step_vs_predicted); predicted_peak_bytes beside torch's reserved peak "
                   "(peak_vs_predicted) and its allocated one, which the plan budgets (allocated_peak_vs_predicted), "
                   "on CUDA only")


def predicted_beside_measured(plan: dict, result: dict) -> dict:
    """The plan's predictions for the mode beside what it measured (issue 17): the figures and their ratios."""
    step = plan.get("predicted_step_seconds")
    blocks = plan.get("predicted_blocks_seconds", step)
    peak = plan.get("predicted_device_peak_bytes")
    compute = (result["forward_seconds"] + result["backward_seconds"]
               if result.get("forward_seconds") is not None and result.get("backward_seconds") is not None else None)
    reserved = result.get("device_peak_reserved_bytes")

    def ratio(measured: Optional[float], predicted: Optional[float]) -> Optional[float]:
        return measured / predicted if measured is not None and predicted else None

    return {"predicted_step_seconds": step, "predicted_blocks_seconds": blocks, "predicted_peak_bytes": peak,
            "rest_of_step_seconds": plan.get("rest_of_step_seconds"), "replanned": plan.get("replanned"),
            "compute_vs_predicted": ratio(compute, blocks), "step_vs_predicted": ratio(result.get("step_seconds"), step),
            "peak_vs_predicted": ratio(reserved, peak),
            # The allocated peak beside the plan's, on CUDA only (the emulated device has no allocator's peaks).
            "allocated_peak_vs_predicted": None if reserved is None else ratio(result.get("device_peak_bytes"), peak),
            "prediction_note": PREDICTION_NOTE}


def _allocated_beside(r: dict) -> str:
    """", allocated X x R": the measured allocated peak and its ratio to the predicted one (CUDA), or ""."""
    if r.get("allocated_peak_vs_predicted") is None:
        return ""
    return f", allocated {fmt_bytes(r['device_peak_bytes'])} x{_fmt(r['allocated_peak_vs_predicted'], '.2f')}"


def print_params_comparison(out: dict) -> None:
    """tierflow-params over DeepSpeed ZeRO-3 offload, and the H100 prediction beside what was measured."""
    pred = out.get("params_prediction")
    if out.get("params_vs_zero3") is not None:
        print(f"tierflow-params over deepspeed-zero3-offload: x{out['params_vs_zero3']:.2f} tokens/s")
    if pred and "tierflow-params" in out.get("modes", {}):
        print(f"tierflow-params PREDICTED on an H100 (not measured): step {pred['step_seconds']:.3g} s, "
              f"{pred['tokens_per_second']:.0f} tokens/s, MFU {pred['mfu']:.3f} ({pred['bound_by']})")
    vs = (out.get("params_prediction_vs_measured") or {}).get("measured_over_predicted")
    if vs:
        print("  measured / predicted: " + ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in vs.items()))


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(out: dict) -> None:
    base = out["modes"].get("baseline", {})
    head = (f"{'mode':<18} {'step s':>8} {'x base':>7} {'fwd s':>8} {'bwd s':>8} {'opt s':>8} {'peak GiB':>9} "
            f"{'final loss':>11} {'max|dloss|':>10}")
    print(head)
    print("-" * len(head))
    for mode, r in out["modes"].items():
        if "error" in r:
            print(f"{mode:<18} FAILED: {r['error'].splitlines()[0][:100] if r['error'] else ''}")
            continue
        if "skipped" in r:
            print(f"{mode:<18} skipped: {r['skipped'][:100]}")
            continue
        peak = r.get("device_peak_bytes")
        agree = out["loss_vs_baseline"].get(mode, {})
        dl = "" if mode == "baseline" or not base or "error" in base else _fmt(agree.get("max_abs_diff"), ".2e")
        print(f"{mode:<18} {_fmt(r['step_seconds'], '8.4f')} {_fmt(out['ratios'].get(mode), '7.2f')} "
              f"{_fmt(r['forward_seconds'], '8.4f')} {_fmt(r['backward_seconds'], '8.4f')} "
              f"{_fmt(r['optimizer_seconds'], '8.4f')} {_fmt(None if peak is None else peak / GiB, '9.2f')} "
              f"{_fmt(r['losses'][-1] if r['losses'] else None, '11.6f')} {dl:>10}")
    if base and base.get("device_peak_bytes") is None:
        print(f"peak: {EMULATED_PEAK_NOTE}")
    tier = [m for m in out["modes"] if m.startswith("tierflow") and m in out["loss_vs_baseline"]]
    if tier and base and "error" not in base:
        print("tierflow against the baseline, max |loss - baseline loss| over all steps (warm-up included):")
        for m in tier:
            a = out["loss_vs_baseline"][m]
            print(f"  {m:<18} {a['max_abs_diff']:.3e} (relative {a['max_rel_diff']:.3e}); step 0 "
                  f"{'bit-identical' if a['first_step_bit_identical'] else 'DIFFERS'}; all steps "
                  f"{'bit-identical' if a['all_steps_bit_identical'] else 'not bit-identical'}")
    saved_modes = [m for m, r in out["modes"].items() if r.get("saved_activations_device_peak_bytes") is not None]
    if saved_modes:
        print("saved activations held on the device, peak over the measured steps (baseline: all it saves):")
    for m in saved_modes:
        print(f"  {m:<18} {fmt_bytes(out['modes'][m]['saved_activations_device_peak_bytes'])}")
    for m, r in out["modes"].items():
        if "streamed_kernel_seconds" in r:
            print(f"{m}: per step, CPU AdamW during backward {r['streamed_kernel_seconds']:.4f} s (backward "
                  f"{_fmt(r.get('backward_seconds'), '.4f')} s), in step() {r['step_kernel_seconds']:.4f} s, "
                  f"step() waited for the CPU {r['step_wait_for_cpu_seconds']:.4f} s, weights waited "
                  f"{r['weight_wait_seconds']:.4f} s; gradients {fmt_bytes(r['grad_bytes_to_host_per_step'])} "
                  f"down in {r['grad_buckets_per_step']:.0f} buckets of {fmt_bytes(r['grad_bucket_bytes'] or 0)}, "
                  f"weights {fmt_bytes(r['weight_bytes_to_device_per_step'])} up; gradients freed on the device "
                  f"before step() {fmt_bytes(r.get('grad_bytes_freed_before_step_per_step') or 0)}")
        if "predicted_step_seconds" in r:
            peak = r.get("device_peak_reserved_bytes")
            print(f"{m}: predicted blocks' forward + backward {_fmt(r.get('predicted_blocks_seconds'), '.4f')} s, "
                  f"measured forward + backward x{_fmt(r['compute_vs_predicted'], '.2f')} of it; predicted whole step "
                  f"{_fmt(r['predicted_step_seconds'], '.4f')} s, measured x{_fmt(r['step_vs_predicted'], '.2f')}"
                  f"{'' if not (r.get('replanned') or {}).get('replanned') else ' (after one re-plan)'}; "
                  f"predicted device peak "
                  f"{fmt_bytes(r['predicted_peak_bytes']) if r['predicted_peak_bytes'] is not None else '-'}, "
                  f"reserved {fmt_bytes(peak) if peak is not None else '- (no device allocator)'}"
                  f"{'' if r['peak_vs_predicted'] is None else ' x' + _fmt(r['peak_vs_predicted'], '.2f')}"
                  f"{_allocated_beside(r)}")
        if r.get("params"):
            pp, per, links = r["params"], r.get("params_per_measured_step") or {}, r.get("per_link_bytes_per_step")
            budget = (r.get("tierflow_settings") or {}).get("gpu_memory", "tierflow's default")
            print(f"{m}: parameters {fmt_bytes(pp.get('host_bytes') or 0)} on the host, device peak of parameters "
                  f"{fmt_bytes(pp.get('device_peak_bytes') or 0)} (budget {budget}); per measured step "
                  f"{per.get('fetches', 0):.0f} fetches, {fmt_bytes(per.get('host_to_device_bytes') or 0)} of weights "
                  f"up, {per.get('prefetch_hits', 0):.0f} prefetch hits, {per.get('stalls', 0):.0f} stalls")
            if links:
                up, down = links["host_to_device"], links["device_to_host"]
                print(f"{m}: links per measured step: host->device {fmt_bytes(up['total'] or 0)}, device->host "
                      f"{fmt_bytes(down['total'] or 0)} (gradients {fmt_bytes(down['gradients'] or 0)})")
        if "tokens_per_second" in r:
            print(f"{m}: {_fmt(r['tokens_per_second'], '.1f')} tokens/s, MFU "
                  f"{_fmt(r.get('mfu'), '.3f') if r.get('mfu') is not None else '- (' + r.get('mfu_note', '') + ')'}")
        if "cpu_step_kernel_seconds" in r:
            print(f"{m}: tierflow's CPU AdamW kernel alone, all {r['cpu_step_kernel_elements']:,} parameters: "
                  f"{r['cpu_step_kernel_seconds']:.4f} s ({r['cpu_step_kernel_params_per_second']:.3g} params/s)")
