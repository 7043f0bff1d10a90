"""A prediction, not a measurement: the tierflow-params mode's step on an H100 from /work/shared/GPU.md's limits.

bench_gpu_offload.py records predict_params_offload(...) in its JSON beside what the mode measured (issue 18:
"predict the figures from shared/GPU.md's limits before you measure them, and say how far the prediction was").
Every figure here is arithmetic on the constants below; nothing is measured.

The model of one step (parameters, gradients and optimizer states offloaded; gradients streamed):
  forward  = max(forward compute, forward link)
             forward link: every bf16 weight host->device once (P bytes), while the planner's swapped
             activations A go device->host: max(P / h2d, (P + A) / duplex)
  backward = max(backward compute, backward link, CPU AdamW)
             backward link: the weights again host->device (P) and the swapped activations back (A), the
             bf16 gradients device->host (P): max((P + A) / h2d, P / d2h, (2P + A) / duplex)
             CPU AdamW: N / (params/s); it steps each bucket of gradients as it lands (Note [Gradient
             streaming]), so it overlaps backward
  step     = forward + backward: the next forward cannot start before the CPU has stepped the first
             block, whose gradients come last in backward, so the CPU's work overlaps backward only.
Compute is 6 N T FLOPs (forward a third, backward two thirds) at an assumed MFU of the compute alone,
taken from GPU.md's measured 1.34B baseline (forward 42 ms + backward 116 ms for 6 * 1.348e9 * 8192 FLOPs).

Activations that do not fit the device budget (beside two blocks' weights and the rest unit) are swapped to the
host as far as the host holds them, and recomputed beyond that: the share s swapped is the one with the shortest
step (a plan's choice, on a grid; ties go to swapping), a recomputed byte costing its share of the forward
compute in backward. The host holds the bf16 weights and gradients (2 + 2 bytes a parameter), the CPU AdamW's
states (fp32 master and m, v in the TIERFLOW_OPTIMIZER_STATES format: 12, 8 or 6.03 bytes a parameter) and the
swapped activations, within HOST_BYTES less HOST_RESERVE_BYTES.

Optimizer states (issue 39): the CPU AdamW is at its memory floor on the node's 16 threads, so its rate with
bf16 or 8-bit moments is GPU.md's fp32 rate times the ratio of bytes a parameter the step moves (28, 20,
16.06), capped by the format's compute: 16 threads at the ceiling a thread measured on the development machine
(STATE_FORMAT_CEILING_PER_THREAD; bench_optimizer.py's compute_ceiling).
``python benchmarks/gpu_offload_predict.py`` writes the llama7b prediction per format to
benchmarks/results/gpu_offload_predict_llama7b.json.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bindings", "python"))
from tierflow import _C  # noqa: E402  (the states' bytes a parameter: tiering's count, one definition)

GB = 1e9
# The H100's dense bf16 peak (SXM datasheet, without sparsity); MFU is read against it on CUDA only.
H100_BF16_DENSE_PEAK_FLOPS = 989e12
# /work/shared/GPU.md, measured on the H100 node (pinned copies, tierflow's CPU AdamW on 16 threads).
H2D_BYTES_PER_S = 55.1 * GB
D2H_BYTES_PER_S = 55.2 * GB
DUPLEX_BYTES_PER_S = 91.4 * GB
CPU_ADAMW_PARAMS_PER_S = 5.0e9  # fp32 master + bf16 gradients and weights
# The node's host memory (GPU.md) and what the prediction leaves to the OS, Python, torch and the CUDA context
# (an assumption).
HOST_BYTES = 128 * (1 << 30)
HOST_RESERVE_BYTES = 8 * (1 << 30)
HOST_COPY_BYTES_PER_PARAM = 2 + 2  # the bf16 weights between uses and the bf16 gradients streamed to the CPU
# Per TIERFLOW_OPTIMIZER_STATES (Note [Optimizer state formats]): bytes a parameter the CPU AdamW's step moves
# (fp32 master read and written, m and v read and written with the 8-bit scales, bf16 gradient in, bf16 weight
# out) and bytes it keeps (master + m + v; tiering::cpu_optimizer_bytes_per_param for bf16 parameters).
STATE_STEP_BYTES_PER_PARAM = {"fp32": 28.0, "bf16": 20.0, "8bit": 16.0 + 2 * 2 * 4 / 256}
STATE_HOST_BYTES_PER_PARAM = {f: _C.cpu_optimizer_bytes_per_param(f, 2) for f in STATE_STEP_BYTES_PER_PARAM}
# Each format's compute ceiling a thread (bench_optimizer.py's compute_ceiling: one thread, 2^19 elements in
# cache, bf16 gradients and copy-out), measured on the development machine (AVX-512, Zen 4) on 2026-11-29; read
# from benchmarks/results/optimizer.json when it has them. The prediction assumes the node's 16 Xeon cores step
# as fast a core (an assumption: the node's cores were not measured in these formats).
STATE_FORMAT_CEILING_PER_THREAD = {"fp32": 2.72e9, "bf16": 1.74e9, "8bit": 1.25e9}
NODE_THREADS = 16


def measured_ceilings() -> tuple[dict, str]:
    """The compute ceilings a thread per format, and where they come from."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "optimizer.json")
    try:
        with open(path) as f:
            c = json.load(f)["compute_ceiling"]["params_per_s_per_thread"]
        return {k: float(c[k]) for k in STATE_FORMAT_CEILING_PER_THREAD}, "benchmarks/results/optimizer.json"
    except (OSError, KeyError, ValueError):
        return dict(STATE_FORMAT_CEILING_PER_THREAD), "the constants in gpu_offload_predict.py"


# GPU.md's 1.34B GPT baseline: forward + backward seconds, parameters, tokens per step, saved activation bytes.
GPT1B_COMPUTE_SECONDS = 0.042 + 0.116
GPT1B_PARAMETERS = 1_348_063_232
GPT1B_TOKENS = 2 * 4096
GPT1B_SAVED_BYTES = 13.05 * (1 << 30)
GPT1B_LAYERS, GPT1B_D_MODEL = 24, 2048


def assumed_compute_mfu() -> float:
    """The compute-alone MFU assumed: the 1.34B baseline's measured 6 N T / (forward + backward) / peak."""
    return 6 * GPT1B_PARAMETERS * GPT1B_TOKENS / GPT1B_COMPUTE_SECONDS / H100_BF16_DENSE_PEAK_FLOPS


def cpu_adamw_rate(states: str, capped: bool = True) -> dict:
    """The CPU AdamW's params/s on the H100 node with moments in `states`: GPU.md's fp32 rate (memory-bound on
    16 threads) times the ratio of bytes a parameter the step moves (the format's memory floor), capped (unless
    not `capped`) by the format's compute: 16 threads at the ceiling a thread measured on the development
    machine. The 2-core development machine is compute-bound in the packed formats (bench_optimizer.py: 8-bit
    0.79x fp32 there); 16 cores sharing the node's memory are not, at these ceilings."""
    floor = STATE_STEP_BYTES_PER_PARAM["fp32"] / STATE_STEP_BYTES_PER_PARAM[states]
    ceilings, source = measured_ceilings()
    by_floor = CPU_ADAMW_PARAMS_PER_S * floor
    by_compute = NODE_THREADS * ceilings[states]
    rate = min(by_floor, by_compute) if capped else by_floor
    return {"params_per_s": rate, "ratio_over_fp32": rate / CPU_ADAMW_PARAMS_PER_S,
            "memory_floor_ratio": floor, "compute_params_per_s": by_compute, "compute_source": source,
            "capped_by": "compute" if capped and by_compute < by_floor else "memory floor",
            "step_bytes_per_param": STATE_STEP_BYTES_PER_PARAM[states],
            "host_state_bytes_per_param": STATE_HOST_BYTES_PER_PARAM[states]}


def saved_activation_bytes(cfg: dict, batch: int) -> float:
    """Activations autograd saves per step, scaled from the 1.34B baseline's bytes per layer, token and d_model,
    times the MLP's share (a SwiGLU of width h saves about 4h per token where a 4d GELU MLP saves 8d)."""
    per = GPT1B_SAVED_BYTES / (GPT1B_LAYERS * GPT1B_TOKENS * GPT1B_D_MODEL)  # bytes per layer x token x d_model
    d = cfg["d_model"]
    hidden = cfg.get("mlp_hidden") or 4 * d
    mlp_extra = (4 * hidden - 8 * d) * 2 / d if cfg.get("mlp") == "swiglu" else 0.0  # bf16 bytes per d_model
    return (per + mlp_extra) * cfg["n_layer"] * batch * cfg["seq_len"] * d


def _one(cfg: dict, n_params: int, block_params: int, batch: int, budget: float, states: str = "fp32",
         capped: bool = True) -> dict:
    tokens = batch * cfg["seq_len"]
    flops = 6 * n_params * tokens
    mfu_compute = assumed_compute_mfu()
    compute = flops / (mfu_compute * H100_BF16_DENSE_PEAK_FLOPS)
    p = 2.0 * n_params                               # bf16 weights (and bf16 gradients), bytes
    acts = saved_activation_bytes(cfg, batch)
    window = 2.0 * (2 * block_params + n_params - cfg["n_layer"] * block_params)  # two blocks + the rest unit
    needed = max(0.0, acts - max(0.0, budget - window))  # what cannot stay on the device
    rate = cpu_adamw_rate(states, capped)
    cpu = n_params / rate["params_per_s"]
    host_fixed = n_params * (HOST_COPY_BYTES_PER_PARAM + rate["host_state_bytes_per_param"])
    host_room = max(0.0, HOST_BYTES - HOST_RESERVE_BYTES - host_fixed)

    def terms(swapped: float) -> tuple:
        recompute = (needed - swapped) / acts * compute / 3 if acts > 0 else 0.0  # its share of the forward
        fwd_link = max(p / H2D_BYTES_PER_S, (p + swapped) / DUPLEX_BYTES_PER_S)
        bwd_link = max((p + swapped) / H2D_BYTES_PER_S, p / D2H_BYTES_PER_S,
                       (2 * p + swapped) / DUPLEX_BYTES_PER_S)
        forward = max(compute / 3, fwd_link)
        backward = max(2 * compute / 3 + recompute, bwd_link, cpu)
        return forward + backward, forward, backward, fwd_link, bwd_link, recompute

    most = min(needed, host_room)
    grid = [most * k / 64 for k in range(65)]
    best = min(terms(s)[0] for s in grid)
    swapped = max(s for s in grid if terms(s)[0] <= best * (1 + 1e-12))  # ties: swap (the link is free)
    step, forward, backward, fwd_link, bwd_link, recompute = terms(swapped)
    bound = ("forward compute" if compute / 3 >= fwd_link else "forward link") + " + " + \
        max((2 * compute / 3 + recompute, "backward compute" + (" and recompute" if recompute > 0 else "")),
            (bwd_link, "backward link"), (cpu, "CPU AdamW"))[1]
    # DeepSpeed ZeRO-3 offload, assumed: the same links and a CPU Adam as fast as tierflow's, stepped after
    # backward (not overlapped with it).
    ds_step = forward + max(2 * compute / 3 + recompute, bwd_link) + cpu
    host = host_fixed + swapped
    return {"batch": batch, "tokens_per_step": tokens, "flops_per_step": flops,
            "compute_seconds": compute, "param_bytes_host_to_device": 2 * p, "grad_bytes_device_to_host": p,
            "host_to_device_bytes": 2 * p + swapped, "device_to_host_bytes": p + swapped,
            "saved_activation_bytes_estimate": acts, "swapped_activation_bytes_estimate": swapped,
            "recomputed_activation_bytes_estimate": needed - swapped, "recompute_seconds": recompute,
            "forward_link_seconds": fwd_link, "backward_link_seconds": bwd_link, "cpu_adamw_seconds": cpu,
            "forward_seconds": forward, "backward_seconds": backward, "step_seconds": step, "bound_by": bound,
            "tokens_per_second": tokens / step, "mfu": flops / step / H100_BF16_DENSE_PEAK_FLOPS,
            "optimizer_states": states, "host_bytes_estimate": host,
            "host_state_bytes": n_params * rate["host_state_bytes_per_param"],
            "fits_host": host_fixed <= HOST_BYTES - HOST_RESERVE_BYTES,
            "deepspeed_zero3_step_seconds_estimate": ds_step, "ratio_over_deepspeed_estimate": ds_step / step}


BATCHES = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def recommended_batch(rows: dict) -> Optional[int]:
    """The batch with the most tokens/s whose host memory fits (the predictor's choice: tierflow's planner plans
    a given batch, it does not choose one); None when the states alone do not fit."""
    fitting = [b for b, r in rows.items() if r["fits_host"]]
    return max(fitting, key=lambda b: (rows[b]["tokens_per_second"], -b)) if fitting else None


def predict_params_offload(cfg: dict, n_params: int, block_params: int, budget_bytes: Optional[float],
                           optimizer_states: str = "fp32", capped: bool = True) -> dict:
    """The prediction for cfg's shape and batch on an H100 (see the module doc) with the CPU AdamW's moments in
    `optimizer_states` (fp32, bf16, 8bit), and its MFU and tokens/s at batches 1 to 16 (the MFU can never pass
    the assumed compute MFU: every other term only adds). `capped`: the CPU AdamW's rate capped by the ratio
    measured per format (else at its memory floor)."""
    if optimizer_states not in STATE_STEP_BYTES_PER_PARAM:
        raise ValueError(f"optimizer_states {optimizer_states!r}; accepted: one of fp32, bf16, 8bit "
                         "(TIERFLOW_OPTIMIZER_STATES)")
    budget = float(budget_bytes or 0)
    main = _one(cfg, n_params, block_params, cfg["batch"], budget, optimizer_states, capped)
    by_batch = {b: _one(cfg, n_params, block_params, b, budget, optimizer_states, capped) for b in BATCHES}
    return dict(main, label="prediction, not measured", device="NVIDIA H100 (limits of /work/shared/GPU.md)",
                parameters=n_params, gpu_memory_bytes=budget_bytes,
                peak_flops=H100_BF16_DENSE_PEAK_FLOPS, assumed_compute_mfu=assumed_compute_mfu(),
                limits={"host_to_device_bytes_per_s": H2D_BYTES_PER_S, "device_to_host_bytes_per_s": D2H_BYTES_PER_S,
                        "duplex_bytes_per_s": DUPLEX_BYTES_PER_S, "cpu_adamw_params_per_s": CPU_ADAMW_PARAMS_PER_S,
                        "host_bytes": HOST_BYTES, "host_reserve_bytes": HOST_RESERVE_BYTES},
                cpu_adamw=cpu_adamw_rate(optimizer_states, capped),
                by_batch={str(b): {k: r[k] for k in ("step_seconds", "tokens_per_second", "mfu", "bound_by",
                                                     "host_bytes_estimate", "fits_host",
                                                     "swapped_activation_bytes_estimate",
                                                     "recomputed_activation_bytes_estimate", "cpu_adamw_seconds")}
                          for b, r in by_batch.items()},
                recommended_batch=recommended_batch(by_batch),
                overlap=("forward = max(compute/3, link); backward = max(2 compute/3, link, CPU AdamW): the CPU "
                         "steps each gradient bucket during backward; the next forward waits for the CPU's last "
                         "bucket (block 0's), so step = forward + backward"),
                note=("bf16 weights host->device twice (forward, backward), bf16 gradients device->host once, "
                      "activations beyond the budget's room swapped within the host's room or recomputed, whichever "
                      "the step prefers (an estimate scaled from the 1.34B baseline), "
                      "compute 6 N T at the assumed compute MFU; DeepSpeed's figure assumes its CPU Adam at "
                      "tierflow's rate after backward"))


def beside_measured(prediction: dict, measured: dict) -> dict:
    """Measured over predicted for the figures both have (the measured mode's step, tokens/s, MFU)."""
    links = measured.get("per_link_bytes_per_step") or {}
    figures = {key: measured.get(key) for key in ("step_seconds", "tokens_per_second", "mfu", "forward_seconds",
                                                   "backward_seconds")}
    figures["host_to_device_bytes"] = (links.get("host_to_device") or {}).get("total")
    figures["device_to_host_bytes"] = (links.get("device_to_host") or {}).get("total")
    out = {}
    for key, m in figures.items():
        p = prediction.get(key)
        out[key] = m / p if m is not None and p else None
    return {"measured_over_predicted": out, "note": "measured / predicted; the prediction is for an H100"}


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_offload_predict_llama7b.json")


def llama7b_by_state_format() -> dict:
    """The llama7b preset within its 16GiB on the H100 node with each TIERFLOW_OPTIMIZER_STATES (issue 39)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_gpu_offload import PRESETS, estimate  # torch: the preset's parameters, counted on the meta device

    cfg = dict(PRESETS["llama7b"], tie_head=False)  # the benchmark's default (--tie-head off)
    est = estimate(cfg)
    budget = float(16 * (1 << 30))
    out = {"label": "PREDICTION, not measured (no GPU was lent): arithmetic on /work/shared/GPU.md's H100 limits",
           "preset": "llama7b", "parameters": est["parameters"], "gpu_memory_bytes": budget,
           "assumed_compute_mfu": assumed_compute_mfu(), "formats": {}}
    for states in STATE_STEP_BYTES_PER_PARAM:
        pred = predict_params_offload(dict(cfg, batch=1), est["parameters"], est["block_parameters"], budget, states)
        out["formats"][states] = {k: pred[k] for k in ("cpu_adamw", "by_batch", "recommended_batch")}
    # What the target needs of the kernel: the 8-bit step at its memory floor (x1.74 fp32), not the measured x1.27.
    pred = predict_params_offload(dict(cfg, batch=1), est["parameters"], est["block_parameters"], budget, "8bit",
                                  capped=False)
    out["formats"]["8bit_at_memory_floor"] = {k: pred[k] for k in ("cpu_adamw", "by_batch", "recommended_batch")}
    return out


def _print(out: dict) -> None:
    print(f"llama7b within 16 GiB on an H100 node, {out['label']}")
    for states, f in out["formats"].items():
        rate = f["cpu_adamw"]
        print(f"{states}: CPU AdamW {rate['params_per_s'] / 1e9:.2f}e9 params/s "
              f"(x{rate['ratio_over_fp32']:.3f} fp32, {rate['capped_by']}), "
              f"{rate['host_state_bytes_per_param']:.3g} bytes of state a parameter; recommended batch "
              f"{f['recommended_batch']}")
        for b, r in f["by_batch"].items():
            print(f"  batch {b:>2}: step {r['step_seconds']:.3f} s, MFU {r['mfu']:.1%}, host "
                  f"{r['host_bytes_estimate'] / 1e9:.1f} GB{'' if r['fits_host'] else ' (does not fit)'}, swapped "
                  f"{r['swapped_activation_bytes_estimate'] / 1e9:.1f} GB, recomputed "
                  f"{r['recomputed_activation_bytes_estimate'] / 1e9:.1f} GB; {r['bound_by']}")


if __name__ == "__main__":
    result = llama7b_by_state_format()
    _print(result)
    with open(RESULTS + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    os.replace(RESULTS + ".tmp", RESULTS)
    print(f"wrote {os.path.relpath(RESULTS)}")
