"""--seq-search: the longest sequence checkpointing and tierflow's planner train on one GPU.

Issue 17's target: `tierflow-auto-fits` trains at least twice checkpointing's longest sequence, at 0.9 of
checkpointing's tokens/s or more. Each trial is a fresh process of a few steps, and at these lengths a step
takes seconds, so the search spends few trials:

- checkpointing: trained at the preset's sequence S and at 2S, its device peak is a line in the sequence
  (flash attention; the saved block inputs, one block's recompute and the logits all grow with it), which
  predicts where it reaches the device's memory; the search tries that, then closes in on the limit;
- the planner: first at twice checkpointing's longest (the target's question), then up or down from there.

Every search stops at its trial count or the shared deadline and says which; `search_longest` is the
search alone (tested with a fake trial in tests/python/test_bench_gpu_offload.py).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

GRAIN = 1024        # sequences tried are multiples of this
GROWTH = 1.25       # above a trained guess with no failure known yet: the next try
CAPACITY = 0.97     # of the device's memory, where the predicted peak is aimed


def predicted_longest(seq_a: int, peak_a: float, seq_b: int, peak_b: float, capacity: float,
                      grain: int = GRAIN) -> Optional[int]:
    """The sequence at which a peak linear in the sequence reaches `capacity` (None: it does not grow)."""
    if seq_b == seq_a:
        return None
    slope = (peak_b - peak_a) / (seq_b - seq_a)
    if not slope > 0:
        return None
    return max(grain, int((seq_a + (capacity - peak_a) / slope) // grain * grain))


def search_longest(trains: Callable[[int], Optional[dict]], lo: int, hi: Optional[int], first: Optional[int],
                   trials: int, deadline: float, grain: int = GRAIN) -> dict:
    """The longest multiple of `grain` that trains, within `trials` calls of ``trains(seq)`` (its result, or
    None when that sequence failed) and before `deadline` (time.monotonic()).

    `lo` is known to train, `hi` (or None) known to fail; `first` is tried first (a prediction) when it lies
    between them. Without a known failure each trained try is followed by one GROWTH times longer; with one,
    the interval is halved. Returns seq (the longest that trained, lo when no try did better), its result
    (None for an untried lo), the trials as [seq, trained] pairs, and why it stopped: "found" (within one
    grain of a failure), "trials" or "deadline".
    """
    best: Optional[dict] = None
    made: list = []
    probe = first if first is not None and first > lo and (hi is None or first < hi) else None
    while True:
        if hi is not None and hi - lo <= grain:
            stopped = "found"
            break
        if len(made) >= trials:
            stopped = "trials"
            break
        if time.monotonic() >= deadline:
            stopped = "deadline"
            break
        if probe is None:
            probe = (lo + hi) // 2 // grain * grain if hi is not None else int(lo * GROWTH) // grain * grain
            probe = max(probe, lo + grain)
            if hi is not None and probe >= hi:
                stopped = "found"
                break
        r = trains(probe)
        made.append([probe, r is not None])
        if r is None:
            hi = probe
        else:
            lo, best = probe, r
        probe = None
    return {"seq": lo, "result": best, "trials": made, "stopped": stopped}


def tokens_per_second(cfg: dict, seq: int, result: dict) -> float:
    return cfg["batch"] * seq / result["step_seconds"]


def seq_search(cfg: dict, run_mode: Callable[[str, dict, float], dict], mode_timeout: float, trials: int,
               seconds: float) -> dict:
    """checkpoint's and tierflow-auto-fits' longest sequences on CUDA (`run_mode` runs one trial), and the
    target's ratios; `trials` per mode, `seconds` for the whole search."""
    if cfg["device"] != "cuda":
        return {"skipped": "needs CUDA: running out of device memory is what ends the search"}
    deadline = time.monotonic() + seconds
    s0 = cfg["seq_len"] // GRAIN * GRAIN or GRAIN

    def trainer(mode: str) -> Callable[[int], Optional[dict]]:
        def trains(seq: int) -> Optional[dict]:
            left = deadline - time.monotonic()
            r = run_mode(mode, dict(cfg, seq_len=seq, warmup=1, steps=2), max(30.0, min(mode_timeout, left)))
            ok = "error" not in r and "step_seconds" in r
            print(f"  sequence {seq}, {mode}: " + (f"trains, {r['step_seconds']:.3f} s a step" if ok else
                                                   "fails: " + r.get("error", "?").splitlines()[0][:120]),
                  flush=True)
            return r if ok else None
        return trains

    out: dict = {"grain": GRAIN, "trials_per_mode": trials, "seconds": seconds}
    ck_trains = trainer("checkpoint")
    a = ck_trains(s0)
    if a is None:
        out["checkpoint"] = {"error": f"does not train at sequence {s0}"}
        return out
    b = ck_trains(2 * s0)
    made = [[s0, True], [2 * s0, b is not None]]
    guess = None
    if b is not None and a.get("device_peak_bytes") and b.get("device_peak_bytes") and a.get("device_total_bytes"):
        guess = predicted_longest(s0, a["device_peak_bytes"], 2 * s0, b["device_peak_bytes"],
                                  CAPACITY * a["device_total_bytes"])
    lo, hi, best = (2 * s0, None, b) if b is not None else (s0, 2 * s0, a)
    ck = search_longest(ck_trains, lo, hi, guess, max(0, trials - 2), deadline)
    ck["trials"] = made + ck["trials"]
    ck["result"] = ck["result"] or best
    out["checkpoint"] = _summary(cfg, ck, guess)
    target = 2 * ck["seq"]
    auto = search_longest(trainer("tierflow-auto-fits"), s0, None, target, trials, deadline)
    if auto["result"] is None:
        out["tierflow-auto-fits"] = dict(_summary(cfg, auto, target), error="trained no sequence above "
                                         f"{s0} within the trials")
    else:
        out["tierflow-auto-fits"] = _summary(cfg, auto, target)
        out["seq_ratio"] = auto["seq"] / ck["seq"]
        out["tokens_per_second_ratio"] = (out["tierflow-auto-fits"]["tokens_per_second"] /
                                          out["checkpoint"]["tokens_per_second"])
    out["target"] = "tierflow-auto-fits' longest >= 2x checkpoint's, at >= 0.9 of its tokens/s"
    return out


def _summary(cfg: dict, found: dict, first: Optional[int]) -> dict:
    r = found["result"]
    out = {"seq": found["seq"], "trials": found["trials"], "stopped": found["stopped"], "tried_first": first}
    if r is not None:
        out.update(step_seconds=r["step_seconds"], tokens_per_second=tokens_per_second(cfg, found["seq"], r),
                   device_peak_bytes=r.get("device_peak_bytes"))
    return out
