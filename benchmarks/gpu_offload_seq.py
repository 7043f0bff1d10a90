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

`predict_longest` is the search's outcome predicted for an H100 from the model's shapes alone, a prediction
and never a measurement: bench_gpu_offload.py records it in the JSON (`longest_seq.prediction`) whether or
not the search runs, and measured over predicted when it does.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from gpu_offload_modes import DTYPES, warmup_needed
from gpu_offload_predict import saved_activation_bytes

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


def predicted_longest_by_phase(seq_a: int, phases_a: dict, seq_b: int, phases_b: dict, capacity: float,
                               grain: int = GRAIN) -> Optional[int]:
    """The shortest of the sequences at which each phase's allocated peak (a line through the two trials'
    `device_phase_bytes`, keys ending in "_allocated") reaches `capacity`; None when no phase grows.

    Per phase, not the step's peak: at the preset's sequence the step's peak can be a phase that does not grow
    with it (torch's AdamW step, 12.63 GiB of checkpointing's 4096-token step on the H100, above its backward's
    11.34), and a line through two peaks of different phases would aim far past the limit.
    """
    found = [predicted_longest(seq_a, phases_a[k], seq_b, phases_b[k], capacity, grain)
             for k in phases_a if k.endswith("_allocated") and k in phases_b]
    found = [n for n in found if n is not None]
    return min(found) if found else None


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


def trial_config(cfg: dict, mode: str, seq: int) -> dict:
    """One trial's configuration: `seq`, and one measured step (a step takes seconds at these lengths) after the
    warm-up `mode` needs (a planned mode's plan comes in force in the third step)."""
    return dict(cfg, seq_len=seq, warmup=max(1, warmup_needed(mode)), steps=1)


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
            r = run_mode(mode, trial_config(cfg, mode, seq), max(30.0, min(mode_timeout, left)))
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
    if b is not None and a.get("device_total_bytes"):
        capacity = CAPACITY * a["device_total_bytes"]
        if a.get("device_phase_bytes") and b.get("device_phase_bytes"):
            guess = predicted_longest_by_phase(s0, a["device_phase_bytes"], 2 * s0, b["device_phase_bytes"],
                                               capacity)
        elif a.get("device_peak_bytes") and b.get("device_peak_bytes"):
            guess = predicted_longest(s0, a["device_peak_bytes"], 2 * s0, b["device_peak_bytes"], capacity)
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


# --- The prediction: the search's outcome on an H100 from the model's shapes alone (never a measurement) ---

H100_DEVICE_BYTES = 79.2 * (1 << 30)  # torch's total_memory of the H100 80GB the leases had, about
# Bytes per logit held at the benchmark's loss (lm_loss: the logits cast to fp32, then cross_entropy): in the
# forward, at log-softmax, the model's logits, their fp32 copy (none when they are fp32 already) and
# log-softmax's fp32 output, which autograd keeps for backward; in the backward, at log-softmax's backward, that
# output, the dense fp32 gradient into it (nll_loss's) and the fp32 gradient out of it.
LOSS_BACKWARD_BYTES = 12


def _phase_lines(cfg: dict, n_params: int, chunked_loss: bool) -> dict:
    """Per phase of a step at its largest: (bytes fixed, bytes per position for checkpointing, for the planner
    with every block input swapped and every block recomputed). Per position: each of the batch's sequences.

    - forward, at the loss: the weights and AdamW's two states (torch's, in the parameters' dtype: no
      gradients between zero_grad and backward), the block inputs (checkpointing keeps all L; the planner one),
      the final norm's and the head's inputs, the loss's logits;
    - backward at the loss: the same with the loss's backward instead of its forward;
    - backward of the last block (the first to run backward): the block inputs not yet used (all L; the
      planner's in flight: two) and one block recomputed (its saved tensors, as the baseline saves them);
    - backward of block 0: every gradient, one input, one block recomputed.
    The model's learned positions grow with the sequence too (gpt_model.GPT.pos: d parameters a position, with
    AdamW's states and, in block 0's backward, their gradient); `n_params` is the model's at cfg["seq_len"].
    With a chunked loss (not the benchmark's: torchtune's and Liger's) the loss's arrays are a chunk's and
    leave the lines."""
    e = DTYPES[cfg["dtype"]].itemsize
    b, d, L, V = cfg["batch"], cfg["d_model"], cfg["n_layer"], cfg["vocab_size"]
    loss_fwd = 0 if chunked_loss else V * (e + (4 if e != 4 else 0) + 4)
    loss_bwd = 0 if chunked_loss else V * LOSS_BACKWARD_BYTES
    head = 2 * d * e
    block = saved_activation_bytes(dict(cfg, seq_len=1, n_layer=1), 1)
    n = n_params - cfg["seq_len"] * d  # the parameters that do not grow with the sequence
    states, grads, pos, pos_grad = 3 * e * n, e * n, 3 * e * d, e * d
    return {
        "forward": (states, pos + b * (L * d * e + head + loss_fwd), pos + b * (d * e + head + loss_fwd)),
        "loss_backward": (states, pos + b * (L * d * e + head + loss_bwd), pos + b * (d * e + head + loss_bwd)),
        "last_block_backward": (states, pos + b * (L * d * e + block), pos + b * (2 * d * e + block)),
        "block0_backward": (states + grads, pos + pos_grad + b * (d * e + block),
                            pos + pos_grad + b * (d * e + block)),
    }


def _longest(lines: dict, which: int, capacity: float) -> tuple[int, str]:
    """The longest multiple of GRAIN whose every phase stays within capacity, and the phase that limits it."""
    return min((max(0, int((capacity - fixed) / per[which - 1] // GRAIN * GRAIN)), phase)
               for phase, (fixed, *per) in lines.items())


PLANNER_CAPACITY = 0.90  # TIERFLOW_GPU_MEMORY's default, which tierflow-auto-fits runs with: the plan's budget


def _work_per_token(cfg: dict, n_params: int, seq: int) -> float:
    """A step's FLOPs per token with every block recomputed: the forward twice and a backward of twice the
    forward, the forward being 2 N for the weights and 2 S d L for causal attention (flash: half the S x S
    scores), so its share grows with the sequence."""
    return 4 * (2 * n_params + 2 * seq * cfg["d_model"] * cfg["n_layer"])


def predict_longest(cfg: dict, n_params: int, device_bytes: float = H100_DEVICE_BYTES) -> dict:
    """Where checkpointing's device peak reaches CAPACITY of an H100's memory and the planner's its default budget
    (PLANNER_CAPACITY: the plan bounds allocated memory by TIERFLOW_GPU_MEMORY), the ratio of
    their tokens/s there (both recompute every block: at their limits nothing else fits), and the same for a
    chunked loss. A prediction from the shapes (`_phase_lines`), never measured; checked against the H100's
    checkpoint step at the preset's sequence in tests/python/test_bench_gpu_offload.py."""
    capacity, planner_capacity = CAPACITY * device_bytes, PLANNER_CAPACITY * device_bytes
    out: dict = {"label": "prediction, not measured", "device": "NVIDIA H100 80GB (79.2 GiB)",
                 "capacity_bytes": capacity, "planner_capacity_bytes": planner_capacity}
    for name, chunked in (("as_run", False), ("loss_chunked", True)):
        lines = _phase_lines(cfg, n_params, chunked)
        (ck, ck_by), (auto, auto_by) = _longest(lines, 1, capacity), _longest(lines, 2, planner_capacity)
        ratio = _work_per_token(cfg, n_params, ck) / _work_per_token(cfg, n_params, auto) if auto else None
        out[name] = {"checkpoint_seq": ck, "checkpoint_limited_by": ck_by, "planner_seq": auto,
                     "planner_limited_by": auto_by, "seq_ratio": auto / ck if ck else None,
                     "tokens_per_second_ratio": ratio,
                     "phase_lines": {p: {"fixed_bytes": f, "checkpoint_bytes_per_position": c,
                                         "planner_bytes_per_position": a} for p, (f, c, a) in lines.items()}}
    # No scheme reaches the target's tokens/s at twice checkpointing's sequence once attention's work per
    # token is large enough: even without recompute (4/3 of checkpointing's rate), 2S's rate over S's is
    # (4/3) (2N + 2 S d L) / (2N + 4 S d L), which falls below 0.9 past this S.
    dl = cfg["d_model"] * cfg["n_layer"]
    out["tokens_per_second_target_unreachable_past_seq"] = int(1.3 * 2 * n_params / (1.4 * 2 * dl))
    out["note"] = ("memory per phase from the shapes (weights, AdamW states, gradients, block inputs, one block "
                   "recomputed as the baseline saves it, the loss's logits); tokens/s from FLOPs per token with "
                   "causal attention's share; as_run is the benchmark's model (the whole fp32 loss at once), "
                   "loss_chunked the same model with a chunked loss")
    return out


def beside_measured(prediction: dict, measured: dict) -> dict:
    """Measured over predicted for the sequences and ratios a search found."""
    p = prediction["as_run"]
    pairs = {"checkpoint_seq": (measured.get("checkpoint") or {}).get("seq"),
             "planner_seq": (measured.get("tierflow-auto-fits") or {}).get("seq"),
             "seq_ratio": measured.get("seq_ratio"), "tokens_per_second_ratio": measured.get("tokens_per_second_ratio")}
    return {k: (m / p[k] if m is not None and p.get(k) else None) for k, m in pairs.items()}
