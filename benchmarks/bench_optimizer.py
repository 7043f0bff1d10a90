"""CPU Adam benchmark: tierflow against torch (fused, foreach), DeepSpeedCPUAdam
and the memory-bandwidth roofline, in one invocation, with the same threads.

    PYTHONPATH=bindings/python .venv/bin/python benchmarks/bench_optimizer.py [--sizes 1e8 1e9] [--threads 2]

Configurations:
  fp32        fp32 params, fp32 grads, state in fp32; every implementation
              does exactly this (28 bytes of traffic per parameter).
  bf16_mixed  fp32 master + m + v, bf16 gradients, bf16 copy of the parameter
              written in the same pass (also 28 bytes per parameter). Neither
              torch nor DeepSpeed keeps an fp32 master for bf16 parameters or
              takes bf16 gradients for fp32 ones, so the like-with-like peer
              run is: an fp32 step, then copying the fp32 parameters into bf16
              ones (the same result: fp32 master, bf16 model weights).

The roofline is a streaming kernel with exactly the step's loads and stores
(same arrays, dtypes, in-place writes, chunking and threads) and one add per
array: optimizer/roofline.hpp. Each timing is the best of several steps after
a warm-up. Writes benchmarks/results/optimizer.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
import tierflow  # noqa: E402
from tierflow._report import write_json_atomic  # noqa: E402

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


class Impl:
    """One implementation set up over its own arrays; `step()` runs one timed step."""

    name = ""

    def step(self) -> None:
        raise NotImplementedError


class Tierflow(Impl):
    name = "tierflow"

    def __init__(self, n: int, config: str, threads: int) -> None:
        self.rt = tierflow._C.Runtime({"cpu_threads": str(threads), "host_memory": "90%"})
        sizes = split(n)
        self.threads = threads
        self.masters = [fill(torch.empty(s), 0.5) for s in sizes]
        self.ms = [torch.zeros(s) for s in sizes]
        self.vs = [torch.zeros(s) for s in sizes]
        gdt = torch.float32 if config == "fp32" else torch.bfloat16
        self.grads = [fill(torch.empty(s, dtype=gdt), 0.01) for s in sizes]
        self.outs = [None] * len(sizes) if config == "fp32" else [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        self.opts = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                         maximize=False, decoupled_weight_decay=True)
        self.n = 0

    def step(self) -> None:
        self.n += 1
        self.rt.adam_step(self.opts, self.n, self.masters, self.ms, self.vs, [None] * len(self.ms), self.grads,
                          self.outs)


class Roofline(Impl):
    """The traffic kernel over a Tierflow's own arrays."""

    name = "roofline"

    def __init__(self, tf: Tierflow) -> None:
        self.tf = tf

    def step(self) -> None:
        tierflow._C.adam_traffic(self.tf.masters, self.tf.ms, self.tf.vs, self.tf.grads, self.tf.outs,
                                 self.tf.threads, 1)


class Peer(Impl):
    """torch.optim.AdamW (fused / foreach) or DeepSpeedCPUAdam, like with like (see the module doc)."""

    def __init__(self, name: str, n: int, config: str, make_opt) -> None:
        self.name = name
        sizes = split(n)
        self.params = [torch.nn.Parameter(fill(torch.empty(s), 0.5)) for s in sizes]
        for p in self.params:
            p.grad = fill(torch.empty_like(p), 0.01)
        self.copies = [torch.empty(s, dtype=torch.bfloat16) for s in sizes] if config == "bf16_mixed" else []
        # One group per tensor: foreach temporaries stay per group, as memory allows at 1e9.
        self.opt = make_opt([{"params": [p]} for p in self.params])

    def step(self) -> None:
        self.opt.step()
        for c, p in zip(self.copies, self.params):
            c.copy_(p.detach())


def deepspeed_factory():
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001  reported, not hidden
        return None, f"import deepspeed failed: {type(e).__name__}: {e}"
    return (lambda groups: DeepSpeedCPUAdam(groups, lr=1e-3, weight_decay=0.01, adamw_mode=True,
                                            fp32_optimizer_states=True)), f"deepspeed {deepspeed.__version__}"


def measure(impls: list, repeats: int) -> dict:
    """Round-robin over the implementations, so every one sees the same machine; best of each."""
    best = {i.name: float("inf") for i in impls}
    for i in impls:
        i.step()  # warm-up (DeepSpeed compiles its op here on first use)
    for _ in range(repeats):
        for i in impls:
            t0 = time.perf_counter()
            i.step()
            best[i.name] = min(best[i.name], time.perf_counter() - t0)
    return best


def run_config(n: int, config: str, threads: int, repeats: int, together: bool) -> dict:
    ds_make, ds_info = deepspeed_factory()
    makers = [
        ("torch_fused", lambda: Peer("torch_fused", n, config,
                                     lambda g: torch.optim.AdamW(g, lr=1e-3, weight_decay=0.01, fused=True))),
        ("torch_foreach", lambda: Peer("torch_foreach", n, config,
                                       lambda g: torch.optim.AdamW(g, lr=1e-3, weight_decay=0.01, foreach=True))),
    ]
    if ds_make is not None:
        makers.append(("deepspeed", lambda: Peer("deepspeed", n, config, ds_make)))
    errors = {}
    times = {}
    tf = Tierflow(n, config, threads)
    core = [tf, Roofline(tf)]
    if together:
        impls = list(core)
        for name, make in makers:
            try:
                impls.append(make())
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
        times = measure(impls, repeats)
        del impls
    else:
        times = measure(core, repeats)
    isa = tf.rt.stats()["optimizer"]["isa"]
    if not together:
        # Too large to hold two implementations at once (1e9 parameters are 16 GB
        # each): tierflow with its roofline, then each peer alone. These ratios are
        # not same-moment, so they carry the machine's drift between the runs.
        del tf, core
        gc.collect()
        for name, make in makers:
            try:
                peer = make()
                times[name] = measure([peer], repeats)[name]
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            peer = None
            gc.collect()
    else:
        del tf, core
        gc.collect()
    if ds_make is None:
        errors["deepspeed"] = ds_info
    return {"times": times, "errors": errors, "isa": isa, "deepspeed": ds_info}


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
        together = n <= 2.5e8  # every implementation's arrays fit in memory at once
        reps = args.repeats if n <= 2.5e8 else max(2, args.repeats // 2)
        for config in ("fp32", "bf16_mixed"):
            r = run_config(n, config, args.threads, reps, together)
            t = r["times"]
            rate = {k: (n / v if v else None) for k, v in t.items()}
            row = {
                "elements": n, "config": config, "threads": args.threads, "isa": r["isa"],
                "measured_together": together,
                "tierflow_params_per_s": rate["tierflow"],
                "roofline_params_per_s": rate["roofline"],
                "torch_fused_params_per_s": rate.get("torch_fused"),
                "torch_foreach_params_per_s": rate.get("torch_foreach"),
                "deepspeed_params_per_s": rate.get("deepspeed"),
                "deepspeed": r["deepspeed"],
                "errors": r["errors"],
                "peer_configuration": ("fp32 step, then a copy of the fp32 parameters into bf16 (peers keep no fp32 "
                                       "master for bf16 parameters and take no bf16 gradients for fp32 ones)"
                                       if config != "fp32" else "the same configuration"),
            }
            row["tierflow_over_roofline"] = rate["tierflow"] / rate["roofline"]
            for peer in ("torch_fused", "torch_foreach", "deepspeed"):
                if rate.get(peer):
                    row[f"tierflow_over_{peer}"] = rate["tierflow"] / rate[peer]
            row["roofline_gbps"] = 28 * rate["roofline"] / 1e9
            results.append(row)
            fmt = lambda x: f"{x:.3e}" if x else "n/a"  # noqa: E731
            print(f'{n:.0e} {config:10s} tierflow {fmt(rate["tierflow"])}/s  roofline {fmt(rate["roofline"])}/s '
                  f'({row["tierflow_over_roofline"]:.2f})  torch fused {fmt(rate.get("torch_fused"))} '
                  f'foreach {fmt(rate.get("torch_foreach"))}  deepspeed {fmt(rate.get("deepspeed"))}  '
                  + "  ".join(f"x{p[len('tierflow_over_'):]}={row[p]:.2f}" for p in row if p.startswith("tierflow_over_")),
                  flush=True)

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
    write_json_atomic(args.out, out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
