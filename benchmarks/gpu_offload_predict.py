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
"""

from __future__ import annotations

from typing import Optional

GB = 1e9
# The H100's dense bf16 peak (SXM datasheet, without sparsity); MFU is read against it on CUDA only.
H100_BF16_DENSE_PEAK_FLOPS = 989e12
# /work/shared/GPU.md, measured on the H100 node (pinned copies, tierflow's CPU AdamW on 16 threads).
H2D_BYTES_PER_S = 55.1 * GB
D2H_BYTES_PER_S = 55.2 * GB
DUPLEX_BYTES_PER_S = 91.4 * GB
CPU_ADAMW_PARAMS_PER_S = 5.0e9  # fp32 master + bf16 gradients and weights
# GPU.md's 1.34B GPT baseline: forward + backward seconds, parameters, tokens per step, saved activation bytes.
GPT1B_COMPUTE_SECONDS = 0.042 + 0.116
GPT1B_PARAMETERS = 1_348_063_232
GPT1B_TOKENS = 2 * 4096
GPT1B_SAVED_BYTES = 13.05 * (1 << 30)
GPT1B_LAYERS, GPT1B_D_MODEL = 24, 2048


def assumed_compute_mfu() -> float:
    """The compute-alone MFU assumed: the 1.34B baseline's measured 6 N T / (forward + backward) / peak."""
    return 6 * GPT1B_PARAMETERS * GPT1B_TOKENS / GPT1B_COMPUTE_SECONDS / H100_BF16_DENSE_PEAK_FLOPS


def saved_activation_bytes(cfg: dict, batch: int) -> float:
    """Activations autograd saves per step, scaled from the 1.34B baseline's bytes per layer, token and d_model,
    times the MLP's share (a SwiGLU of width h saves about 4h per token where a 4d GELU MLP saves 8d)."""
    per = GPT1B_SAVED_BYTES / (GPT1B_LAYERS * GPT1B_TOKENS * GPT1B_D_MODEL)  # bytes per layer x token x d_model
    d = cfg["d_model"]
    hidden = cfg.get("mlp_hidden") or 4 * d
    mlp_extra = (4 * hidden - 8 * d) * 2 / d if cfg.get("mlp") == "swiglu" else 0.0  # bf16 bytes per d_model
    return (per + mlp_extra) * cfg["n_layer"] * batch * cfg["seq_len"] * d


def _one(cfg: dict, n_params: int, block_params: int, batch: int, budget: float) -> dict:
    tokens = batch * cfg["seq_len"]
    flops = 6 * n_params * tokens
    mfu_compute = assumed_compute_mfu()
    compute = flops / (mfu_compute * H100_BF16_DENSE_PEAK_FLOPS)
    p = 2.0 * n_params                               # bf16 weights (and bf16 gradients), bytes
    acts = saved_activation_bytes(cfg, batch)
    window = 2.0 * (2 * block_params + n_params - cfg["n_layer"] * block_params)  # two blocks + the rest unit
    swapped = max(0.0, acts - max(0.0, budget - window))  # what the planner must move to the host
    fwd_link = max(p / H2D_BYTES_PER_S, (p + swapped) / DUPLEX_BYTES_PER_S)
    bwd_link = max((p + swapped) / H2D_BYTES_PER_S, p / D2H_BYTES_PER_S, (2 * p + swapped) / DUPLEX_BYTES_PER_S)
    cpu = n_params / CPU_ADAMW_PARAMS_PER_S
    forward = max(compute / 3, fwd_link)
    backward = max(2 * compute / 3, bwd_link, cpu)
    step = forward + backward
    bound = ("forward compute" if compute / 3 >= fwd_link else "forward link") + " + " + \
        max((2 * compute / 3, "backward compute"), (bwd_link, "backward link"), (cpu, "CPU AdamW"))[1]
    # DeepSpeed ZeRO-3 offload, assumed: the same links and a CPU Adam as fast as tierflow's, stepped after
    # backward (not overlapped with it).
    ds_step = forward + max(2 * compute / 3, bwd_link) + cpu
    return {"batch": batch, "tokens_per_step": tokens, "flops_per_step": flops,
            "compute_seconds": compute, "param_bytes_host_to_device": 2 * p, "grad_bytes_device_to_host": p,
            "host_to_device_bytes": 2 * p + swapped, "device_to_host_bytes": p + swapped,
            "saved_activation_bytes_estimate": acts, "swapped_activation_bytes_estimate": swapped,
            "forward_link_seconds": fwd_link, "backward_link_seconds": bwd_link, "cpu_adamw_seconds": cpu,
            "forward_seconds": forward, "backward_seconds": backward, "step_seconds": step, "bound_by": bound,
            "tokens_per_second": tokens / step, "mfu": flops / step / H100_BF16_DENSE_PEAK_FLOPS,
            "deepspeed_zero3_step_seconds_estimate": ds_step, "ratio_over_deepspeed_estimate": ds_step / step}


def predict_params_offload(cfg: dict, n_params: int, block_params: int, budget_bytes: Optional[float]) -> dict:
    """The prediction for cfg's shape and batch on an H100 (see the module doc), and its MFU and tokens/s at
    batches 1, 2, 4 and 8 (the MFU can never pass the assumed compute MFU: every other term only adds)."""
    budget = float(budget_bytes or 0)
    main = _one(cfg, n_params, block_params, cfg["batch"], budget)
    by_batch = {b: _one(cfg, n_params, block_params, b, budget) for b in (1, 2, 4, 8)}
    return dict(main, label="prediction, not measured", device="NVIDIA H100 (limits of /work/shared/GPU.md)",
                parameters=n_params, gpu_memory_bytes=budget_bytes,
                peak_flops=H100_BF16_DENSE_PEAK_FLOPS, assumed_compute_mfu=assumed_compute_mfu(),
                limits={"host_to_device_bytes_per_s": H2D_BYTES_PER_S, "device_to_host_bytes_per_s": D2H_BYTES_PER_S,
                        "duplex_bytes_per_s": DUPLEX_BYTES_PER_S, "cpu_adamw_params_per_s": CPU_ADAMW_PARAMS_PER_S},
                by_batch={str(b): {k: r[k] for k in ("step_seconds", "tokens_per_second", "mfu", "bound_by")}
                          for b, r in by_batch.items()},
                overlap=("forward = max(compute/3, link); backward = max(2 compute/3, link, CPU AdamW): the CPU "
                         "steps each gradient bucket during backward; the next forward waits for the CPU's last "
                         "bucket (block 0's), so step = forward + backward"),
                note=("bf16 weights host->device twice (forward, backward), bf16 gradients device->host once, "
                      "activations beyond the budget's room swapped (an estimate scaled from the 1.34B baseline), "
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
