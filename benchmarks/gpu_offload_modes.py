"""The peers and the parameter-offload mode of benchmarks/bench_gpu_offload.py: DeepSpeed's engines (ZeRO-2 with
the optimizer on the CPU, ZeRO-3 with parameters and optimizer on the CPU) and tierflow-params' figures
(the report's params section, tokens/s, MFU)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Optional

import torch

from gpu_offload_predict import H100_BF16_DENSE_PEAK_FLOPS

# DeepSpeed's modes: ZeRO stage and whether the parameters are offloaded too.
DEEPSPEED_MODES = {"deepspeed-offload": 2, "deepspeed-zero3-offload": 3}
PARAMS_MODE = "tierflow-params"
PARAMS_PEER = "deepspeed-zero3-offload"
# The params section of tierflow's report, recorded as it stands at the end (counters cover the whole run, the
# device peak too: the schedule's peak is not reset with the activations') and per measured step.
PARAMS_COUNTERS = ("fetches", "host_to_device_bytes", "prefetch_hits", "stalls")
PARAMS_LEVELS = ("device_peak_bytes", "host_bytes")

# The modes bench_gpu_offload.py runs, and the tierflow settings of each.
MODES = ["baseline", "save_on_cpu", "checkpoint", "tierflow-host", "tierflow-nvme", "tierflow-host-opt",
         "tierflow-opt", "deepspeed-offload", "tierflow-auto", "tierflow-auto-half", "tierflow-auto-fits", PARAMS_MODE,
         PARAMS_PEER]
AUTO_MODES = ("tierflow-auto", "tierflow-auto-half", "tierflow-auto-fits")
# The planned modes given a device budget (bench_gpu_offload.auto_budget): checkpointing's peak, and halfway
# from it to the baseline's.
BUDGETED_AUTO_MODES = ("tierflow-auto", "tierflow-auto-half")
PLANNED_MODES = AUTO_MODES + (PARAMS_MODE,)  # profile two steps, plan before the third


def warmup_needed(mode: str) -> int:
    """The warm-up steps `mode` needs before a measured step: a planned mode's plan comes in force in the third."""
    return 3 if mode in PLANNED_MODES else 0


# Opt-in: the baseline again in another process. Its distance from the baseline is the run-to-run noise
# of the losses (on CUDA, kernels that accumulate with atomics), the floor for reading the others'.
EXTRA_MODES = ["baseline-rerun"]
TIERFLOW_MODES: dict[str, dict[str, str]] = {
    "tierflow-host": dict(offload_activations="host", offload_optimizer="none"),
    "tierflow-nvme": dict(offload_activations="nvme", offload_optimizer="none"),
    "tierflow-host-opt": dict(offload_activations="host", offload_optimizer="host", weights_return="forward"),
    "tierflow-opt": dict(offload_activations="none", offload_optimizer="host", weights_return="forward"),
    "tierflow-auto": dict(offload_activations="auto", offload_optimizer="none"),
    "tierflow-auto-half": dict(offload_activations="auto", offload_optimizer="none"),
    "tierflow-auto-fits": dict(offload_activations="auto", offload_optimizer="none"),
    PARAMS_MODE: dict(offload_params="host", offload_optimizer="host", offload_activations="auto"),
}
CPU_OPTIMIZER_MODES = ("tierflow-host-opt", "tierflow-opt", PARAMS_MODE)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def link_bytes(result: dict) -> dict:
    """Bytes per measured step on each link, split by what crossed it (tierflow's report: the links' counters
    hold everything; the params section the weights, the gradient stream the gradients)."""
    per = (result.get("tierflow") or {}).get("per_measured_step") or {}
    h2d, d2h = per.get("links.host_to_gpu_bytes"), per.get("links.gpu_to_host_bytes")
    weights = (result.get("params_per_measured_step") or {}).get("host_to_device_bytes")
    grads = result.get("grad_bytes_to_host_per_step")
    return {"host_to_device": {"total": h2d, "weights": weights,
                               "other": h2d - weights if h2d is not None and weights is not None else None},
            "device_to_host": {"total": d2h, "gradients": grads,
                               "other": d2h - grads if d2h is not None and grads is not None else None},
            "note": "per measured step; other: the swapped activations (and anything else the links carried)"}


class SkipMode(Exception):
    """A mode that cannot run here (a missing package, no GPU): recorded as skipped with the reason."""


def deepspeed_engine(model: torch.nn.Module, cfg: dict, cuda: bool, stage: int = 2) -> Any:
    """DeepSpeed, one process: ZeRO stage 2 with the optimizer offloaded to the CPU (ZeRO-Offload), or stage 3
    with the parameters offloaded as well (offload_param and offload_optimizer to cpu, pinned).

    AdamW with torch's defaults but lr, as the other modes; DeepSpeedCPUAdam steps on the host.
    """
    try:
        import deepspeed
    except ImportError as e:
        raise SkipMode(f"the deepspeed package is not installed ({e}); `make bench` installs it") from e
    if not cuda:
        what = "ZeRO-Offload" if stage == 2 else "ZeRO-3 offload"
        raise SkipMode(f"DeepSpeed {what} needs a CUDA GPU; this run is on the CPU (emulated device)")

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl")
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                  "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg["lr"], "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": zero,
        "bf16": {"enabled": cfg["dtype"] == "bf16"},
        "steps_per_print": 1 << 30,
    }
    if cfg.get("max_grad_norm") is not None:
        ds_config["gradient_clipping"] = cfg["max_grad_norm"]
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine


def throughput(cfg: dict, result: dict, cuda: bool) -> dict:
    """tokens/s and MFU (6 * parameters * tokens / step seconds / the peak) of a measured mode.

    MFU is read against H100_BF16_DENSE_PEAK_FLOPS on CUDA with bf16 parameters only; otherwise it is null
    with the reason.
    """
    step = result.get("step_seconds")
    tokens = cfg["batch"] * cfg["seq_len"]
    out: dict = {"tokens_per_step": tokens, "tokens_per_second": tokens / step if step else None}
    reason: Optional[str] = None
    if not cuda:
        reason = "no MFU on the CPU (emulated device): the peak is an H100's bf16 dense peak"
    elif cfg["dtype"] != "bf16":
        reason = f"the peak is the H100's bf16 dense peak; these parameters are {cfg['dtype']}"
    elif not step:
        reason = "no measured step"
    n = result.get("parameters")
    out["mfu"] = None if reason else 6 * n * tokens / step / H100_BF16_DENSE_PEAK_FLOPS
    out["mfu_note"] = reason or (f"6 * {n} parameters * {tokens} tokens / step_seconds / "
                                 f"{H100_BF16_DENSE_PEAK_FLOPS:.3g} FLOP/s (H100 bf16 dense; on "
                                 f"{result.get('device_name')})")
    return out


def params_summary(before: dict, after: dict, steps: int) -> dict:
    """The report's params section: as it stands after the run, and its counters per measured step."""
    a, b = after.get("params") or {}, before.get("params") or {}
    if not a:
        return {}
    per_step = {k: (a.get(k, 0) - b.get(k, 0)) / steps for k in PARAMS_COUNTERS if k in a}
    return {"params": {k: a[k] for k in PARAMS_COUNTERS + PARAMS_LEVELS if k in a},
            "params_per_measured_step": per_step,
            "params_note": "tierflow's report()['params'] after the run (counters and device peak over the whole "
                           "run: the parameter schedule's peak is not reset before the measured steps); "
                           "params_per_measured_step: counters after minus before the measured steps, per step"}


def time_cpu_step_kernel(runtime: Any, opt: torch.optim.Optimizer, repeats: int) -> dict:
    """tierflow's CPU AdamW kernel alone (session.runtime.adam_step) over the model's parameters.

    It steps the optimizer's own fp32 master, exp_avg and exp_avg_sq (host tensors of the parameters'
    sizes; no second copy of 12 bytes per parameter), with gradients and written-back weights in the
    parameters' dtype on the CPU, as CPUAdamW._step_group calls it. A parameter without a state on the
    host (not stepped yet, or in the GPU share: TIERFLOW_GPU_OPTIMIZER_FRACTION) gets host tensors of
    its own, so that the figure is always the CPU kernel over every parameter. Run after the measured
    steps: it changes the optimizer's state.
    """
    masters, ms, vs, grads, outs = [], [], [], [], []
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            if all(k in state and state[k].device.type == "cpu" for k in ("master", "exp_avg", "exp_avg_sq")):
                masters.append(state["master"].view(-1))
                ms.append(state["exp_avg"].view(-1))
                vs.append(state["exp_avg_sq"].view(-1))
            else:
                masters.append(p.detach().reshape(-1).to("cpu", torch.float32, copy=True))  # never the model's
                ms.append(torch.zeros(p.numel()))
                vs.append(torch.zeros(p.numel()))
            grads.append(torch.full((p.numel(),), 1e-3, dtype=p.dtype))
            outs.append(torch.empty(p.numel(), dtype=p.dtype))
    options = type(opt)._options(opt.param_groups[0])
    vmaxes = [None] * len(masters)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        runtime.adam_step(options, 1000 + i, masters, ms, vs, vmaxes, grads, outs)
        if i:
            times.append(time.perf_counter() - t0)
    n = sum(m.numel() for m in masters)
    med = statistics.median(times)
    return {"cpu_step_kernel_seconds": med, "cpu_step_kernel_all_seconds": times,
            "cpu_step_kernel_params_per_second": n / med, "cpu_step_kernel_elements": n,
            "cpu_step_kernel_grad_dtype": str(grads[0].dtype).replace("torch.", "")}
