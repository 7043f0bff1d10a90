"""GPT training with and without offload: plain torch, torch's own remedies, and tierflow, in one run.

    PYTHONPATH=bindings/python .venv/bin/python benchmarks/bench_gpu_offload.py --preset gpt1b
    PYTHONPATH=bindings/python .venv/bin/python benchmarks/bench_gpu_offload.py --preset tiny --device cpu

Each mode trains the same GPT (benchmarks/gpt_model.py; same seeded initial
weights, same seeded random tokens, AdamW at the same learning rate) for
--warmup + --steps steps:

  baseline           plain torch, torch.optim.AdamW with torch's defaults
  save_on_cpu        torch.autograd.graph.save_on_cpu(pin_memory=True) around forward
  checkpoint         torch.utils.checkpoint.checkpoint per block (use_reentrant=False)
  tierflow-host      tierflow.wrap: activations to the pinned host pool, torch's AdamW kept
  tierflow-nvme      tierflow.wrap: activations to NVMe swap files, torch's AdamW kept
  tierflow-host-opt  tierflow.wrap: activations to host, AdamW on the CPU (tierflow.CPUAdamW), gradients
                     streamed to the host in buckets during backward and freed on the device once there
                     (TIERFLOW_OFFLOAD_GRADIENTS=on; --offload-gradients off keeps them), weights back
                     during the next forward (Note [Gradient streaming]; TIERFLOW_WEIGHTS_RETURN=forward)
  tierflow-opt       tierflow.wrap: activations kept on the device, AdamW on the CPU, streamed as in
                     tierflow-host-opt: the like-for-like peer of deepspeed-offload
  deepspeed-offload  DeepSpeed ZeRO stage 2 with offload_optimizer: cpu (ZeRO-Offload), the peer; needs
                     the deepspeed package and a CUDA GPU, and is recorded as skipped, with the reason,
                     otherwise
  tierflow-auto      tierflow.wrap with the activation planner (TIERFLOW_OFFLOAD_ACTIVATIONS=auto) and
                     TIERFLOW_GPU_MEMORY at the checkpoint mode's device peak (on the CPU, which has no
                     device allocator: weights + grads + AdamW states + 60% of the baseline's saved
                     activations); torch's AdamW kept
  tierflow-auto-half the same, TIERFLOW_GPU_MEMORY halfway from the checkpoint mode's device peak to the
                     baseline's (on the CPU: 80% of the saved activations): the plans between the two
  tierflow-auto-fits the planner with the default budget (everything fits on a large GPU: keep all)
  tierflow-params    everything offloaded (issue 18): parameters on the host between uses
                     (TIERFLOW_OFFLOAD_PARAMS=host), AdamW on the CPU stepping the host copies, gradients
                     freed on the device, activations planned (auto) within the preset's params_gpu_memory;
                     records the report's params section, tokens/s, MFU (CUDA, bf16) and, beside them, a
                     prediction from shared/GPU.md's limits (benchmarks/gpu_offload_predict.py)
  deepspeed-zero3-offload  DeepSpeed ZeRO stage 3 with offload_param and offload_optimizer to cpu
                     (pinned), tierflow-params' peer (skipped, with the reason, without deepspeed or CUDA);
                     the JSON's params_vs_zero3 is tierflow-params' tokens/s over its own when both ran
  baseline-rerun     (opt-in) the baseline again, in another process: the losses' run-to-run noise

Every mode runs in a fresh process (this script with --worker MODE: gpu_offload_worker.py), so device
peaks and allocator caches do not mix; a mode that fails records its error and
the others go on. Times are medians over the measured steps. The planner's modes
profile during their first two steps and plan before the third: they run at
least 3 warm-up steps. --seq-search also finds, on CUDA, the longest sequence
(a multiple of 1024) that checkpoint and tierflow-auto-fits (default budget) train
without running out of device memory, and their tokens/s there, in few trials
(--seq-search-trials per mode, --seq-search-seconds in all; gpu_offload_seq.py); the JSON's
longest_seq.prediction is that outcome predicted for an H100 from the shapes, with or without the search
(never measured; measured over predicted beside it when the search ran). On CUDA each step
is bracketed by torch.cuda.synchronize() and its phases are timed with CUDA
events on the compute stream (read after the synchronize, so they are honest
and the phases still overlap as in an unmeasured loop). On the CPU (tierflow's
emulated device) phases are wall-clock.

Correctness sits next to speed: every mode's losses are compared with the
baseline's. Step 0 must be bit-identical everywhere (same weights, same data).
With offload_optimizer="none" tierflow's activation offload is an exact copy,
so later steps should be bit-identical too. Where a GPU kernel accumulates with
atomics, two baseline runs can differ in the last bits: add the opt-in mode
baseline-rerun to measure that floor. save_on_cpu(pin_memory=True) packs each
saved tensor into a new contiguous pinned tensor (strides are lost, views of
one storage become separate copies, weights are copied too), so backward may
run other GEMM kernels: on an H100 its losses differed from the baseline's by
one fp32 ulp at some steps, reproducibly, for the tiny preset.
tierflow-host-opt steps fp32 master weights on the CPU, which differs from
torch's AdamW by rounding (and, for bf16 parameters, by torch's AdamW having no
fp32 master at all).

Presets: gpt1b (GPU.md's 1.34B GPT), llama7b (issue 18's 7B Llama shape within 16GiB: run it with
--modes tierflow-params,deepspeed-zero3-offload), tiny (seconds on the CPU) and tiny-params (tiny made
deep enough for tierflow-params to hold a third of its parameters on the device). With either of the
parameter modes the JSON holds params_prediction: the tierflow-params step on an H100 predicted from
shared/GPU.md's limits (gpu_offload_predict.py; a prediction, never measured), measured over it when the
mode ran on CUDA, and params_vs_zero3.

Writes benchmarks/results/gpu_offload.json for --preset gpt1b on a GPU
(gpu_offload_<preset>.json for other presets); on the CPU it writes to
$TMPDIR/gpu_offload_<preset>_emulated.json unless --out is given, so it never
replaces GPU results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import GPT, Block, parameter_count  # noqa: E402
import gpu_offload_seq  # noqa: E402
from gpu_offload_modes import BUDGETED_AUTO_MODES, DTYPES, EXTRA_MODES, MODES, PARAMS_MODE, PARAMS_PEER  # noqa: E402
from gpu_offload_predict import STATE_HOST_BYTES_PER_PARAM, beside_measured, predict_params_offload  # noqa: E402
from gpu_offload_report import (GiB, loss_agreement, parse_bytes, print_params_comparison,  # noqa: E402
                                print_table, write_json_atomic)
from gpu_offload_worker import gpt_config, worker_main  # noqa: E402  (one mode, in its own process)

PRESETS: dict[str, dict[str, Any]] = {
    # The 1.34B GPT of /work/shared/GPU.md (baseline on an H100: step 0.162 s, device peak 25.06 GiB,
    # 13.05 GiB of saved activations).
    "gpt1b": dict(n_layer=24, d_model=2048, n_head=16, seq_len=4096, batch=2, vocab_size=32000, dtype="bf16",
                  warmup=3, steps=5, min_offload_bytes=None, prefetch_bytes=None, nvme_memory="24GiB",
                  params_gpu_memory="8GiB"),
    # Issue 18's GPU target: a 7B Llama shape (SwiGLU MLP of 11008; 6.76e9 parameters with this GPT's biases and
    # learned positions), trained by tierflow-params within 16GiB of device memory. On an H100 its baseline
    # modes run out of memory: run it with --modes tierflow-params,deepspeed-zero3-offload.
    "llama7b": dict(n_layer=32, d_model=4096, n_head=32, mlp_hidden=11008, mlp="swiglu", seq_len=4096, batch=1,
                    vocab_size=32000, dtype="bf16", warmup=3, steps=5, min_offload_bytes=None, prefetch_bytes=None,
                    nvme_memory="64GiB", params_gpu_memory="16GiB"),
    # A few seconds per mode on a 2-core CPU. At this size (about 1.1 MiB saved per step) tierflow's
    # defaults would offload almost nothing: most tensors are below its 64KiB threshold, and the NVMe
    # mode keeps the last prefetch_bytes saved (64MiB by default) on the device. So everything is
    # offloaded, and only the last 256KiB stay.
    "tiny": dict(n_layer=2, d_model=64, n_head=4, seq_len=64, batch=2, vocab_size=256, dtype="fp32",
                 warmup=3, steps=5, min_offload_bytes="0", prefetch_bytes="256KiB", nvme_memory="256MiB"),
    # tierflow-params on the CPU: the tiny model made deep enough (16 blocks of 195 KiB of fp32 parameters, 3.19 MiB
    # in all) that its parameters are several times a budget the plan accepts (the largest unit and one more
    # prefetched, 390 KiB, one block's gradients in flight, 195 KiB, a working set and the prefetch window). In
    # the 2-layer tiny preset those two blocks and the rest unit are nearly all of the parameters.
    "tiny-params": dict(n_layer=16, d_model=64, n_head=4, seq_len=64, batch=1, vocab_size=256, dtype="fp32",
                        warmup=3, steps=5, min_offload_bytes="0", prefetch_bytes="64KiB", nvme_memory="256MiB",
                        params_gpu_memory="1MiB"),
}

# ---------------------------------------------------------------------------------------------- parent
def fs_type(path: str) -> str:
    """The file system type of the mount holding `path` (tmpfs cannot do O_DIRECT)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")):
                    if len(fields[1]) >= len(best):
                        best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def run_mode(mode: str, cfg: dict, timeout_s: float) -> dict:
    """Runs one mode in a fresh process and returns its results (or the error)."""
    fd, out_path = tempfile.mkstemp(prefix=f"gpu-offload-{mode}-", suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "bindings", "python"),
                                                    env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--worker-config", json.dumps(cfg),
           "--worker-out", out_path]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        with open(out_path) as f:
            text = f.read()
        result = json.loads(text) if text.strip() else {"mode": mode, "losses": []}
        if proc.returncode != 0 or not text.strip():
            result["error"] = result.get("error") or f"worker exited with status {proc.returncode}"
        if "error" in result:
            result["stderr_tail"] = proc.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        result = {"mode": mode, "losses": [], "error": f"timed out after {timeout_s:.0f} s",
                  "stderr_tail": stderr[-4000:]}
    finally:
        os.unlink(out_path)
    result["process_seconds"] = time.perf_counter() - t0
    return result


def estimate(cfg: dict) -> dict:
    gcfg = gpt_config(cfg)
    n = parameter_count(gcfg)
    with torch.device("meta"):
        built = sum(p.numel() for p in GPT(gcfg).parameters())  # the real module, without memory
        block = sum(p.numel() for p in Block(gcfg).parameters())
    elt = torch.finfo(DTYPES[cfg["dtype"]]).bits // 8
    return {"parameters": n, "parameters_built": built,
            # weights, gradients, AdamW's exp_avg and exp_avg_sq, all in the parameters' dtype (torch's AdamW)
            "weights_grads_adam_bytes": 4 * elt * n,
            # tierflow-host-opt: fp32 master, exp_avg, exp_avg_sq on the host, the moments in
            # TIERFLOW_OPTIMIZER_STATES's format (12, 8 or 6.03 bytes a parameter: Note [Optimizer state formats])
            "host_optimizer_state_bytes": int(n * STATE_HOST_BYTES_PER_PARAM[optimizer_states()]),
            "optimizer_states": optimizer_states(), "block_parameters": block}


def optimizer_states() -> str:
    """The moments' format this run's CPU AdamW keeps (TIERFLOW_OPTIMIZER_STATES; fp32 by default)."""
    return os.environ.get("TIERFLOW_OPTIMIZER_STATES", "fp32").strip().lower() or "fp32"


def auto_budget(mode: str, results: dict, est: dict) -> tuple[int, str]:
    """TIERFLOW_GPU_MEMORY of tierflow-auto: the checkpoint mode's device peak; of tierflow-auto-half: halfway
    from it to the baseline's (see the module doc)."""
    ck = results.get("checkpoint", {}).get("device_peak_bytes")
    base = results.get("baseline", {}).get("device_peak_bytes")
    if mode == "tierflow-auto" and ck:
        return int(ck), "the checkpoint mode's device peak"
    if mode == "tierflow-auto-half" and ck and base:
        return int((ck + base) // 2), "halfway from the checkpoint mode's device peak to the baseline's"
    saved = results.get("baseline", {}).get("saved_activations_bytes") or 0
    share = 0.6 if mode == "tierflow-auto" else 0.8
    return (int(est["weights_grads_adam_bytes"] + share * saved),
            "no device peaks to read (emulated device, or no checkpoint or baseline run): weights + grads + AdamW "
            f"states + {share:.0%} of the baseline's saved activations")


def predicted_params_mode(cfg: dict, est: dict) -> dict:
    """tierflow-params' step on an H100 for this shape, from GPU.md's limits (a prediction, not measured)."""
    return predict_params_offload(cfg, est["parameters"], est["block_parameters"],
                                  parse_bytes(cfg.get("params_gpu_memory")), optimizer_states=optimizer_states())


def print_prediction(p: dict) -> None:
    budget = "tierflow's default" if p["gpu_memory_bytes"] is None else f"{p['gpu_memory_bytes'] / GiB:.3g} GiB"
    print(f"tierflow-params on an H100 within TIERFLOW_GPU_MEMORY {budget}, PREDICTION (not measured), from "
          f"shared/GPU.md's limits: step "
          f"{p['step_seconds']:.3f} s = forward {p['forward_seconds']:.3f} s + backward {p['backward_seconds']:.3f} s "
          f"({p['bound_by']}); weights {p['param_bytes_host_to_device'] / 1e9:.1f} GB host->device, gradients "
          f"{p['grad_bytes_device_to_host'] / 1e9:.1f} GB device->host, activations swapped (estimate) "
          f"{p['swapped_activation_bytes_estimate'] / 1e9:.1f} GB each way; CPU AdamW {p['cpu_adamw_seconds']:.3f} s; "
          f"compute {p['compute_seconds']:.3f} s at an assumed compute MFU of {p['assumed_compute_mfu']:.3f}; "
          f"{p['tokens_per_second']:.0f} tokens/s, MFU {p['mfu']:.3f}; DeepSpeed ZeRO-3 offload (estimate) "
          f"{p['deepspeed_zero3_step_seconds_estimate']:.3f} s, tierflow-params over it "
          f"x{p['ratio_over_deepspeed_estimate']:.2f}")


def params_vs_peer(results: dict, prediction: dict) -> dict:
    """The prediction; beside it what tierflow-params measured (on CUDA) and its tokens/s over ZeRO-3's."""
    mine, peer = results.get(PARAMS_MODE, {}), results.get(PARAMS_PEER, {})
    ran = {m: "error" not in r and "skipped" not in r and r.get("tokens_per_second")
           for m, r in ((PARAMS_MODE, mine), (PARAMS_PEER, peer))}
    out: dict = {"params_prediction": prediction}
    if ran[PARAMS_MODE] and mine.get("device_name") != "emulated":
        out["params_prediction_vs_measured"] = beside_measured(prediction, mine)
    out["params_vs_zero3"] = (mine["tokens_per_second"] / peer["tokens_per_second"] if all(ran.values()) else None)
    if not all(ran.values()):
        out["params_vs_zero3_note"] = "needs both tierflow-params and deepspeed-zero3-offload measured in this run"
    return out


def default_out(cfg: dict) -> str:
    if cfg["device"] == "cuda":
        name = "gpu_offload.json" if cfg["preset"] == "gpt1b" else f"gpu_offload_{cfg['preset']}.json"
        return os.path.join(ROOT, "benchmarks", "results", name)
    return os.path.join(tempfile.gettempdir(), f"gpu_offload_{cfg['preset']}_emulated.json")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="GPT training with and without activation/optimizer offload")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt1b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="parameter dtype (default: the preset's)")
    ap.add_argument("--steps", type=int, help="measured steps (default: the preset's)")
    ap.add_argument("--warmup", type=int, help="warm-up steps before them (default: the preset's)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated, from: " + ", ".join(MODES + EXTRA_MODES) + " (default: all but the last)")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    help="cuda when available, else cpu (tierflow's emulated device)")
    ap.add_argument("--out", help="JSON path (default: see the module doc)")
    ap.add_argument("--nvme-path", help="directory for tierflow-nvme's swap files (default: a temporary "
                                        "directory under build/, on the repository's file system)")
    ap.add_argument("--nvme-memory", help="NVMe budget of tierflow-nvme (default: the preset's)")
    ap.add_argument("--host-memory", help="tierflow's host pool budget (default: tierflow's)")
    ap.add_argument("--prefetch-bytes", help="tierflow's prefetch window, also the NVMe mode's resident tail "
                                             "(default: the preset's)")
    ap.add_argument("--min-offload-bytes", help="tierflow's offload threshold (default: the preset's)")
    ap.add_argument("--grad-bucket-bytes", help="tierflow-host-opt's gradient bucket size (default: auto)")
    ap.add_argument("--offload-gradients", choices=["on", "off"], default="on",
                    help="the CPU-optimizer modes free each gradient on the device once it is on the host "
                         "(TIERFLOW_OFFLOAD_GRADIENTS), as ZeRO-Offload does (default: on)")
    ap.add_argument("--max-grad-norm", type=float,
                    help="clip to this global norm in every mode: clip_grad_norm_ before torch's step, "
                         "TIERFLOW_MAX_GRAD_NORM for the CPU-optimizer modes, gradient_clipping for DeepSpeed")
    ap.add_argument("--params-gpu-memory", help="tierflow-params' TIERFLOW_GPU_MEMORY (default: the preset's)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tie-head", action="store_true", help="tie the LM head to the token embedding")
    ap.add_argument("--kernel-repeats", type=int, default=5, help="repeats of the CPU AdamW kernel timing")
    ap.add_argument("--mode-timeout", type=float, default=1800.0, help="seconds one mode may take")
    ap.add_argument("--dry-run", action="store_true", help="print the configuration and estimates, run nothing")
    ap.add_argument("--seq-search", action="store_true",
                    help="CUDA: the longest sequence checkpoint and tierflow-auto-fits train, with tokens/s "
                         "(benchmarks/gpu_offload_seq.py)")
    ap.add_argument("--seq-search-trials", type=int, default=6, help="--seq-search's trials per mode (default 6)")
    ap.add_argument("--seq-search-seconds", type=float, default=420.0,
                    help="--seq-search's time for both modes together (default 420)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-config", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def resolve(args: argparse.Namespace) -> dict:
    cfg = dict(PRESETS[args.preset], preset=args.preset)
    for key in ("dtype", "steps", "warmup", "nvme_memory", "min_offload_bytes", "prefetch_bytes", "grad_bucket_bytes",
                "params_gpu_memory"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        raise SystemExit(f"--max-grad-norm {args.max_grad_norm}: accepted, a positive number")
    cfg.update(offload_gradients=args.offload_gradients, max_grad_norm=args.max_grad_norm)
    cfg.update(lr=args.lr, seed=args.seed, tie_head=args.tie_head, kernel_repeats=args.kernel_repeats,
               host_memory=args.host_memory,
               device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
               loss_dtype="fp32", optimizer="AdamW (torch defaults but lr)")
    if cfg["steps"] < 1 or cfg["warmup"] < 0:
        raise SystemExit("--steps must be at least 1 and --warmup at least 0")
    return cfg


def assemble(cfg: dict, est: dict, modes: list[str], results: dict[str, dict], longest: dict,
             prediction: dict) -> dict:
    """The results JSON from the modes run so far."""
    base = results.get("baseline", {})
    ok = {m: r for m, r in results.items() if "error" not in r and "skipped" not in r}
    base_ok = "baseline" in ok
    device_name = next((r["device_name"] for r in ok.values() if "device_name" in r),
                       "emulated" if cfg["device"] == "cpu" else None)
    out = {
        "device": device_name,
        "preset": cfg["preset"],
        "config": dict(cfg, parameters=est["parameters"]),
        "torch": torch.__version__,
        "host": {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                 "platform": platform.platform(), "python": platform.python_version()},
        "modes": results,
        "ratios": {m: r["step_seconds"] / base["step_seconds"] for m, r in ok.items()} if base_ok else {},
        "peak_ratio": {m: (r["device_peak_bytes"] / base["device_peak_bytes"]
                           if r.get("device_peak_bytes") is not None and base.get("device_peak_bytes") else None)
                       for m, r in ok.items()} if base_ok else {},
        "loss_vs_baseline": {m: loss_agreement(base["losses"], r["losses"]) for m, r in ok.items()
                             if m != "baseline"} if base_ok else {},
        "longest_seq": longest,
    }
    if PARAMS_MODE in modes or PARAMS_PEER in modes:
        out.update(params_vs_peer(results, prediction))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, json.loads(args.worker_config), args.worker_out)

    cfg = resolve(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES + EXTRA_MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES + EXTRA_MODES)}")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no GPU (use --device cpu for the emulated device)")
    est = estimate(cfg)
    gcfg = gpt_config(cfg)
    print(f"preset {cfg['preset']}: {cfg['n_layer']} layers, d_model {cfg['d_model']}, {cfg['n_head']} heads, "
          f"MLP {gcfg.mlp} {gcfg.hidden}, seq {cfg['seq_len']}, batch {cfg['batch']}, vocab {cfg['vocab_size']}, "
          f"{cfg['dtype']}, device {cfg['device']}")
    print(f"parameters {est['parameters']:,} ({est['parameters']:.3g}; built on the meta device: "
          f"{est['parameters_built']:,}); weights + grads + AdamW states {est['weights_grads_adam_bytes'] / GiB:.2f} "
          f"GiB on the device; tierflow-host-opt's fp32 master + states {est['host_optimizer_state_bytes'] / GiB:.2f} "
          f"GiB on the host")
    print(f"{cfg['warmup']} warm-up + {cfg['steps']} measured steps per mode; modes: {', '.join(modes)}")
    prediction = predicted_params_mode(cfg, est)
    if PARAMS_MODE in modes:
        print_prediction(prediction)
    if args.dry_run:
        return 0

    made_nvme_dir = None
    if "tierflow-nvme" in modes:
        if args.nvme_path:
            os.makedirs(args.nvme_path, exist_ok=True)
            cfg["nvme_path"] = args.nvme_path
        else:
            parent = os.path.join(ROOT, "build")
            made_nvme_dir = tempfile.mkdtemp(prefix="bench-gpu-offload-nvme-",
                                             dir=parent if os.path.isdir(parent) else None)
            cfg["nvme_path"] = made_nvme_dir
        cfg["nvme_fs_type"] = fs_type(cfg["nvme_path"])
        print(f"tierflow-nvme swap files in {cfg['nvme_path']} ({cfg['nvme_fs_type']})")

    results: dict[str, dict] = {}
    path = args.out or default_out(cfg)
    seq_prediction = gpu_offload_seq.predict_longest(cfg, est["parameters"])
    try:
        for mode in modes:
            if mode in BUDGETED_AUTO_MODES:
                budget, note = auto_budget(mode, results, est)
                cfg.setdefault("auto_gpu_memory", {})[mode] = budget
                cfg.setdefault("auto_gpu_memory_note", {})[mode] = note
                print(f"  {mode}'s TIERFLOW_GPU_MEMORY: {budget} bytes ({note})")
            r = run_mode(mode, cfg, args.mode_timeout)
            results[mode] = r
            status = ("FAILED: " + r["error"].splitlines()[0][:160]) if "error" in r else \
                ("skipped: " + r["skipped"]) if "skipped" in r else \
                f"step {r['step_seconds']:.4f} s, final loss {r['losses'][-1]:.6f}"
            print(f"  {mode:<18} {status}  ({r['process_seconds']:.1f} s)", flush=True)
            # After every mode, so a run stopped part-way (a device lease's limit) keeps what finished.
            write_json_atomic(path, assemble(cfg, est, modes, results,
                                             {"skipped": "not reached yet", "prediction": seq_prediction}, prediction))
    finally:
        if made_nvme_dir:
            shutil.rmtree(made_nvme_dir, ignore_errors=True)

    longest = gpu_offload_seq.seq_search(cfg, run_mode, args.mode_timeout, args.seq_search_trials,
                                         args.seq_search_seconds) \
        if args.seq_search else {"skipped": "not asked (--seq-search)"}
    longest["prediction"] = seq_prediction
    if "seq_ratio" in longest:
        longest["measured_over_predicted"] = gpu_offload_seq.beside_measured(seq_prediction, longest)
    out = assemble(cfg, est, modes, results, longest, prediction)
    write_json_atomic(path, out)
    print()
    print_table(out)
    print_params_comparison(out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
