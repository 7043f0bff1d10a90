"""CPU Adam benchmark: tierflow against torch (fused, foreach), DeepSpeedCPUAdam
and the memory-bandwidth roofline, in one invocation, with the same threads.

    PYTHONPATH=bindings/python .venv/bin/python benchmarks/bench_optimizer.py [--sizes 1e8 1e9] [--threads 2]

Configurations:
  fp32        fp32 params, fp32 grads, state in fp32; every implementation
              does exactly this (28 bytes of traffic per parameter).
  bf16_mixed  fp32 master + m + v, bf16 gradients, bf16 copy of the parameter
              written in the same pass (also 28 bytes per parameter). torch
              keeps no fp32 master for bf16 parameters, so its like-with-like
              comparison is its fp32 run (the same bytes); DeepSpeed is
              measured with whatever its CPU Adam supports (see its "how").

The roofline is a streaming kernel with exactly the step's loads and stores
(same arrays, dtypes, in-place writes, chunking and threads) and one add per
array: optimizer/roofline.hpp. Each timing is the best of several steps after
a warm-up. Writes benchmarks/results/optimizer.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
import tierflow  # noqa: E402

CHUNK = 125_000_000  # elements per tensor: 1e9 parameters are 8 tensors


def split(n: int) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(CHUNK, n))
        n -= sizes[-1]
    return sizes


def best_of(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fill(t: torch.Tensor, value: float) -> torch.Tensor:
    return t.fill_(value)


def bench_tierflow(n: int, config: str, threads: int, repeats: int) -> dict:
    rt = tierflow._C.Runtime({"cpu_threads": str(threads), "host_memory": "90%"})
    sizes = split(n)
    masters = [fill(torch.empty(s), 0.5) for s in sizes]
    ms = [torch.zeros(s) for s in sizes]
    vs = [torch.zeros(s) for s in sizes]
    gdt = torch.float32 if config == "fp32" else torch.bfloat16
    grads = [fill(torch.empty(s, dtype=gdt), 0.01) for s in sizes]
    outs = [None] * len(sizes) if config == "fp32" else [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    opts = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                maximize=False, decoupled_weight_decay=True)
    step = [0]

    def one():
        step[0] += 1
        rt.adam_step(opts, step[0], masters, ms, vs, [None] * len(sizes), grads, outs)

    t = best_of(one, repeats)
    isa = rt.stats()["optimizer"]["isa"]
    # The roofline over the very same arrays, right after.
    roof = tierflow._C.adam_traffic(masters, ms, vs, grads, outs, threads, repeats + 1)
    del masters, ms, vs, grads, outs
    gc.collect()
    return {"tierflow_s": t, "roofline_s": roof, "isa": isa}


def bench_torch(n: int, threads: int, repeats: int, **flags) -> float:
    sizes = split(n)
    params = [torch.nn.Parameter(fill(torch.empty(s), 0.5)) for s in sizes]
    for p in params:
        p.grad = fill(torch.empty_like(p), 0.01)
    # One group per tensor: foreach temporaries stay per group, as memory allows at 1e9.
    opt = torch.optim.AdamW([{"params": [p]} for p in params], lr=1e-3, weight_decay=0.01, **flags)
    t = best_of(opt.step, repeats)
    del opt, params
    gc.collect()
    return t


def bench_deepspeed(n: int, config: str, threads: int, repeats: int) -> dict:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: WPS433
    except Exception as e:  # noqa: BLE001  reported, not hidden
        return {"error": f"import deepspeed failed: {type(e).__name__}: {e}"}
    sizes = split(n)
    try:
        if config == "fp32":
            params = [torch.nn.Parameter(fill(torch.empty(s), 0.5)) for s in sizes]
            for p in params:
                p.grad = fill(torch.empty_like(p), 0.01)
            how = "fp32 params and grads, fp32 state"
        else:
            params = [torch.nn.Parameter(fill(torch.empty(s, dtype=torch.bfloat16), 0.5)) for s in sizes]
            for p in params:
                p.grad = fill(torch.empty_like(p), 0.01)
            how = ("bf16 params and grads with fp32_optimizer_states=True: fp32 m and v, but no fp32 "
                   "master (the bf16 parameter itself is updated), so 20 bytes per parameter, not 28")
        opt = DeepSpeedCPUAdam([{"params": [p]} for p in params], lr=1e-3, weight_decay=0.01,
                               adamw_mode=True, fp32_optimizer_states=True)
        t = best_of(opt.step, repeats)
        del opt, params
        gc.collect()
        return {"s": t, "how": how}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description="CPU Adam benchmark")
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e8, 1e9])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "optimizer.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    results = []
    for size in args.sizes:
        n = int(size)
        reps = args.repeats if n <= 2e8 else max(2, args.repeats // 2)
        fused = bench_torch(n, args.threads, reps, fused=True)
        foreach = bench_torch(n, args.threads, reps, foreach=True)
        for config in ("fp32", "bf16_mixed"):
            tf = bench_tierflow(n, config, args.threads, reps)
            ds = bench_deepspeed(n, config, args.threads, reps)
            row = {
                "elements": n, "config": config, "threads": args.threads, "isa": tf["isa"],
                "tierflow_params_per_s": n / tf["tierflow_s"],
                "roofline_params_per_s": n / tf["roofline_s"],
                "torch_fused_params_per_s": n / fused,
                "torch_foreach_params_per_s": n / foreach,
                "torch_comparison": "fp32 run (torch has no fp32 master for bf16 params)" if config != "fp32" else "same configuration",
                "deepspeed_params_per_s": (n / ds["s"]) if "s" in ds else None,
                "deepspeed": ds,
            }
            row["tierflow_over_roofline"] = row["tierflow_params_per_s"] / row["roofline_params_per_s"]
            row["tierflow_over_torch_fused"] = row["tierflow_params_per_s"] / row["torch_fused_params_per_s"]
            row["tierflow_over_torch_foreach"] = row["tierflow_params_per_s"] / row["torch_foreach_params_per_s"]
            if row["deepspeed_params_per_s"]:
                row["tierflow_over_deepspeed"] = row["tierflow_params_per_s"] / row["deepspeed_params_per_s"]
            row["roofline_gbps"] = 28 * row["roofline_params_per_s"] / 1e9
            results.append(row)
            ds_txt = f'{row["deepspeed_params_per_s"]:.3e}' if row["deepspeed_params_per_s"] else "n/a"
            print(f'{n:.0e} {config:10s} tierflow {row["tierflow_params_per_s"]:.3e}/s  roofline '
                  f'{row["roofline_params_per_s"]:.3e}/s ({row["tierflow_over_roofline"]:.2f})  torch fused '
                  f'{row["torch_fused_params_per_s"]:.3e}  foreach {row["torch_foreach_params_per_s"]:.3e}  '
                  f'deepspeed {ds_txt}', flush=True)

    head = results[0]
    out = {
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "headline": f'{head["elements"]:.0e} elements, {head["config"]}',
        "tierflow_params_per_s": head["tierflow_params_per_s"],
        "torch_fused_params_per_s": head["torch_fused_params_per_s"],
        "torch_foreach_params_per_s": head["torch_foreach_params_per_s"],
        "deepspeed_params_per_s": head["deepspeed_params_per_s"],
        "roofline_params_per_s": head["roofline_params_per_s"],
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
    os.replace(tmp, args.out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
