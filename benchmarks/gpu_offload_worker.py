"""One mode of benchmarks/bench_gpu_offload.py, trained in its own process (``bench_gpu_offload.py --worker
MODE``): the model and batches, the timed steps (CUDA events on CUDA, each phase's device peak), and the result
JSON the parent reads (medians, peaks, tierflow's report, the losses)."""

from __future__ import annotations

import json
import math
import resource
import time
import traceback
from typing import Any, Optional

import torch

from gpt_model import GPT, GPTConfig, lm_loss
from gpu_offload_modes import (BUDGETED_AUTO_MODES, CPU_OPTIMIZER_MODES, DEEPSPEED_MODES, DTYPES, PARAMS_MODE,
                               PARAMS_PEER,
                               TIERFLOW_MODES, SkipMode, deepspeed_engine, link_bytes, params_summary, throughput,
                               time_cpu_step_kernel, warmup_needed)
from gpu_offload_report import (EMULATED_PEAK_NOTE, _TIERFLOW_IMPORT_ERROR, _median, predicted_beside_measured,
                                stream_summary, tierflow_summary, write_json_atomic)


def tierflow_settings(mode: str, cfg: dict, cuda: bool) -> dict:
    """tierflow.wrap's keyword arguments for a tierflow mode and the command line's settings."""
    import tierflow

    settings: dict[str, Any] = dict(TIERFLOW_MODES[mode])
    for key in ("min_offload_bytes", "host_memory", "prefetch_bytes"):
        if cfg.get(key) is not None:
            settings[key] = cfg[key]
    if mode in CPU_OPTIMIZER_MODES and cfg.get("grad_bucket_bytes") is not None:
        settings["grad_bucket_bytes"] = cfg["grad_bucket_bytes"]
    if mode in CPU_OPTIMIZER_MODES:
        settings["offload_gradients"] = cfg["offload_gradients"]
        if cfg.get("max_grad_norm") is not None:  # clipped inside step(), from the streamed norms
            settings["max_grad_norm"] = str(cfg["max_grad_norm"])
    if mode == "tierflow-nvme":
        settings.update(nvme_paths=[cfg["nvme_path"]], nvme_memory=cfg["nvme_memory"])
    if mode in BUDGETED_AUTO_MODES and (cfg.get("auto_gpu_memory") or {}).get(mode):
        settings["gpu_memory"] = str(cfg["auto_gpu_memory"][mode])
    if mode == PARAMS_MODE and cfg.get("params_gpu_memory"):  # else tierflow's default budget
        settings["gpu_memory"] = str(cfg["params_gpu_memory"])
    known = {row["name"] for row in tierflow.config_table()}
    if not cuda and "TIERFLOW_DEVICE" in known:
        settings["device"] = "emulated"  # a CPU model on a machine that also has a GPU
    return settings


class PhasePeaks:
    """CUDA, the measured steps: each phase's device peak, allocated and reserved, the largest over the steps, and
    what forward leaves allocated for backward: where a mode's device memory goes, not only how much. The caching
    allocator counts on the host, so reading and resetting its peaks needs no synchronize."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self.device = device  # None: no device allocator (the emulated device)
        self.measuring = False
        self.bytes: dict[str, int] = {}

    def _keep(self, key: str, value: int) -> None:
        self.bytes[key] = max(self.bytes.get(key, 0), int(value))

    def begin_step(self) -> None:
        if self.device is not None and self.measuring:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end_phase(self, phase: str) -> None:
        if self.device is None or not self.measuring:
            return
        self._keep(f"{phase}_allocated", torch.cuda.max_memory_allocated(self.device))
        self._keep(f"{phase}_reserved", torch.cuda.max_memory_reserved(self.device))
        if phase == "forward":
            self._keep("after_forward_allocated", torch.cuda.memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def into(self, result: dict) -> None:
        if self.bytes:
            result["device_phase_bytes"] = self.bytes
            result["device_phase_note"] = ("per phase of the measured steps, the largest: the device peak allocated "
                                           "and reserved (torch.cuda.max_memory_*), and after_forward_allocated, "
                                           "what the forward leaves allocated for backward (weights, optimizer "
                                           "states, saved tensors)")


def finish_result(mode: str, cfg: dict, result: dict, phases: dict, device: torch.device, session: Any,
                  before: dict, opt: Any, batches: list, forward: Any) -> None:
    """The medians, peaks and tierflow's report of a mode's run, into `result`."""
    cuda = device.type == "cuda"
    measured = slice(cfg["warmup"], None)
    for name, values in phases.items():
        result[f"{name}_seconds"] = _median(values[measured])
        result[f"{name}_all_seconds"] = values
    if mode in (PARAMS_MODE, PARAMS_PEER):
        result.update(throughput(cfg, result, cuda))
    if mode in CPU_OPTIMIZER_MODES:
        result["phase_note"] = ("CPUAdamW steps each bucket of gradients as soon as it has landed on the "
                                "host (Note [Gradient streaming]): that work overlaps backward_seconds, "
                                "optimizer_seconds is what step() has left to do (the buckets still on the "
                                "CPU when backward ends, redone ones), and with TIERFLOW_WEIGHTS_RETURN="
                                "forward the weights' copies overlap the next forward: on CUDA the compute "
                                "stream waits per module, inside forward_seconds; weight_wait_seconds is the "
                                "host's share of that wait (all of it on the emulated device)")
    if cuda:
        phase = result.get("device_phase_bytes", {})  # the peaks were reset at each phase: their largest
        result["device_peak_bytes"] = max((v for k, v in phase.items() if k.endswith("_allocated")),
                                          default=torch.cuda.max_memory_allocated(device))
        result["device_peak_reserved_bytes"] = max((v for k, v in phase.items() if k.endswith("_reserved")),
                                                   default=torch.cuda.max_memory_reserved(device))
        result["device_peak_note"] = "torch.cuda.max_memory_allocated over the measured steps"
    else:
        result["device_peak_bytes"] = None
        result["device_peak_note"] = EMULATED_PEAK_NOTE

    if session is not None:
        report = json.loads(json.dumps(session.report()))
        result["tierflow"] = tierflow_summary(before, report, cfg["steps"])
        result["tierflow_report"] = report
        result["saved_activations_device_peak_bytes"] = report["activations"]["device_bytes"]["peak"]
        if mode in CPU_OPTIMIZER_MODES:
            result.update(stream_summary(before, report, cfg["steps"]))
        if mode in CPU_OPTIMIZER_MODES and mode != PARAMS_MODE:  # not beside 7B of host copies: 4 bytes more each
            result.update(time_cpu_step_kernel(session.runtime, opt, cfg["kernel_repeats"]))
        result.update(params_summary(before, report, cfg["steps"]))
        if mode == PARAMS_MODE:
            result["per_link_bytes_per_step"] = link_bytes(result)
        if "plan" in report:
            result["plan"] = report["plan"]
            result.update(predicted_beside_measured(report["plan"], result))
    elif mode == "baseline" and _TIERFLOW_IMPORT_ERROR is None:
        # One more forward and backward, untimed and without a step, that counts what autograd saves.
        import tierflow

        meter = tierflow.SavedActivationMeter()
        meter.begin_forward()
        x, y = batches[-1]
        with meter.hooks():
            loss = forward(x, y)
        loss.backward()
        opt.zero_grad(set_to_none=True)
        result["saved_activations_bytes"] = meter.peak_bytes
        result["saved_activations_device_peak_bytes"] = meter.peak_bytes
    else:
        result["saved_activations_device_peak_bytes"] = None


def gpt_config(cfg: dict) -> GPTConfig:
    """The GPT of a resolved configuration (a preset with the command line's settings)."""
    return GPTConfig(n_layer=cfg["n_layer"], d_model=cfg["d_model"], n_head=cfg["n_head"], seq_len=cfg["seq_len"],
                     vocab_size=cfg["vocab_size"], tie_head=cfg["tie_head"], mlp_hidden=cfg.get("mlp_hidden"),
                     mlp=cfg.get("mlp", "gelu"))


def model_and_batches(mode: str, cfg: dict, device: torch.device, result: dict) -> tuple:
    """The mode's GPT (the same seeded weights in every mode) and its warm-up and measured batches."""
    cuda = device.type == "cuda"
    dtype = DTYPES[cfg["dtype"]]
    gcfg = gpt_config(cfg)
    torch.manual_seed(cfg["seed"])  # initial weights: the same in every mode (and on the same device kind)
    with torch.device(device):
        model = GPT(gcfg)
    model.to(dtype)
    if cuda:
        torch.cuda.empty_cache()  # the fp32 weights before the cast
    result["parameters"] = sum(p.numel() for p in model.parameters())
    model.checkpoint_blocks = mode == "checkpoint"

    if cfg["warmup"] < warmup_needed(mode):
        raise ValueError(f"{mode} profiles two steps and plans before the third: it needs --warmup "
                         f"{warmup_needed(mode)} or more")
    total = cfg["warmup"] + cfg["steps"]
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)  # data: the same in every mode
    batches = []
    for _ in range(total):
        tokens = torch.randint(0, gcfg.vocab_size, (cfg["batch"], gcfg.seq_len + 1), generator=gen)
        batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return model, batches


def _train(mode: str, cfg: dict, result: dict) -> None:
    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    result["device_name"] = torch.cuda.get_device_name(device) if cuda else "emulated"
    if cuda:  # what --seq-search aims the predicted peak at
        result["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    t_setup = time.perf_counter()
    model, batches = model_and_batches(mode, cfg, device, result)
    total = len(batches)
    engine = deepspeed_engine(model, cfg, cuda, DEEPSPEED_MODES[mode]) if mode in DEEPSPEED_MODES else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"]) if engine is None else engine.optimizer
    session = None
    if mode in TIERFLOW_MODES:
        import tierflow

        settings = tierflow_settings(mode, cfg, cuda)
        model, opt = tierflow.wrap(model, opt, **settings)
        session = model._tierflow_session
        result["tierflow_settings"] = settings
    result["optimizer"] = f"{type(opt).__module__}.{type(opt).__name__}"
    result["setup_seconds"] = time.perf_counter() - t_setup

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return lm_loss(model(x), y)
        if engine is not None:
            return lm_loss(engine(x), y)
        return lm_loss(model(x), y)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    peaks = PhasePeaks(device if cuda else None)

    def timed_step(x: torch.Tensor, y: torch.Tensor) -> tuple:
        """One step: its loss and (step, forward, backward, optimizer) seconds (CUDA events on CUDA)."""
        sync()
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        peaks.begin_step()
        t0 = time.perf_counter()
        if cuda:
            events[0].record()
        loss = forward(x, y)
        if cuda:
            events[1].record()
        t1 = time.perf_counter()
        peaks.end_phase("forward")
        if engine is not None:
            engine.backward(loss)
        else:
            loss.backward()
        if cuda:
            events[2].record()
        t2 = time.perf_counter()
        peaks.end_phase("backward")
        if engine is not None:
            engine.step()  # and zeroes the gradients (and clips, with gradient_clipping)
        else:
            if cfg.get("max_grad_norm") is not None and mode not in CPU_OPTIMIZER_MODES:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            events[3].record()
        t3 = time.perf_counter()
        peaks.end_phase("optimizer")
        sync()
        t4 = time.perf_counter()
        if cuda:
            fwd, bwd, step = (events[k].elapsed_time(events[k + 1]) / 1e3 for k in range(3))
        else:
            fwd, bwd, step = t1 - t0, t2 - t1, t3 - t2
        return loss, (t4 - t0, fwd, bwd, step)

    phases: dict[str, list[float]] = {"step": [], "forward": [], "backward": [], "optimizer": []}
    losses = result["losses"]
    before: dict = {}
    for i in range(total):
        if i == cfg["warmup"]:
            peaks.measuring = True
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                result["device_allocated_before_measured_bytes"] = torch.cuda.memory_allocated(device)
            if session is not None:
                session.runtime.reset_peaks()
                before = json.loads(json.dumps(session.report()))
        x, y = batches[i]
        loss, (t4_t0, fwd, bwd, step) = timed_step(x, y)
        for name, value in (("step", t4_t0), ("forward", fwd), ("backward", bwd), ("optimizer", step)):
            phases[name].append(value)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss {losses[-1]} at step {i}")

    peaks.into(result)
    finish_result(mode, cfg, result, phases, device, session, before, opt, batches, forward)


def worker_main(mode: str, cfg: dict, out_path: str) -> int:
    result: dict[str, Any] = {"mode": mode, "losses": []}
    try:
        _train(mode, cfg, result)
    except SkipMode as e:
        result["skipped"] = str(e)
    except Exception as e:  # noqa: BLE001  recorded in the JSON; the other modes go on
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    result["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write_json_atomic(out_path, result)
    return 0
