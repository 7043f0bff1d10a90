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

  bf16_states, 8bit_states
              bf16_mixed with the moments kept as bf16 (20 bytes a
              parameter) or as 8-bit block-wise codes with a scale per 256
              (16 + 8*2/256): TIERFLOW_OPTIMIZER_STATES, Note [Optimizer state
              formats]. Each has its own roofline (the traffic kernel moving
              that format's bytes). Peers of the same format, where they
              install: bitsandbytes' AdamW8bit and torchao's AdamW8bit on the
              CPU (fp32 parameters and gradients, 8-bit moments, no separate
              master), DeepSpeedCPUAdam with fp32_optimizer_states=False and
              torch's fused AdamW on bf16 parameters (bf16 moments, no fp32
              master). They move fewer bytes than tierflow (no fp32 master:
              14 for the 8-bit peers, 14 for the bf16 ones), so their ratio
              understates tierflow's efficiency; each row says so.

The roofline is a streaming kernel with exactly the step's loads and stores
(same arrays, dtypes, in-place writes, chunking and threads) and one add per
array: optimizer/roofline.hpp. Every implementation steps the same shared
arrays (see Arrays), so all of them are timed round-robin in one process, at
every size. Each rate is the best round after a warm-up; each ratio is the
median over rounds of the ratio within a round (see ratios). The JSON keeps
every round's seconds. Writes benchmarks/results/optimizer.json.
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
# Configurations whose moments are not fp32, and their TIERFLOW_OPTIMIZER_STATES format.
STATE_FORMATS = {"bf16_states": "bf16", "8bit_states": "8bit"}
# Bytes a parameter each configuration's step moves (its roofline's access pattern).
TRAFFIC_BYTES = {"fp32": 28, "bf16_mixed": 28, "bf16_states": 20, "8bit_states": 16 + 2 * 8 / 256}
# Host state a parameter: fp32 master + the two moments (scales included).
STATE_BYTES = {c: tierflow._C.cpu_optimizer_bytes_per_param(STATE_FORMATS.get(c, "fp32"), 2)
               for c in ("fp32", "bf16_mixed", "bf16_states", "8bit_states")}


def split(n: int) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(CHUNK, n))
        n -= sizes[-1]
    return sizes


def fill(t: torch.Tensor, value: float) -> torch.Tensor:
    return t.fill_(value)


class Arrays:
    """The step's arrays, allocated once and shared by every implementation.

    Every implementation steps the same memory (torch and DeepSpeed get them as
    their parameters, gradients and pre-filled optimizer state), so all of them
    fit at once even at 1e9 parameters and are timed round-robin, at the same
    moment of this shared machine. The arithmetic costs the same whatever the
    values; they stay normal numbers over the few steps taken.
    """

    def __init__(self, n: int, config: str) -> None:
        sizes = split(n)
        self.masters = [fill(torch.empty(s), 0.5) for s in sizes]
        self.format = STATE_FORMATS.get(config, "fp32")
        if self.format == "8bit":  # one uint8 buffer a moment: codes, padding, scales (Note [Optimizer state formats])
            self.ms = [torch.zeros(tierflow._C.moment_bytes("8bit", s), dtype=torch.uint8) for s in sizes]
            self.vs = [torch.zeros(tierflow._C.moment_bytes("8bit", s), dtype=torch.uint8) for s in sizes]
        else:
            dt = torch.bfloat16 if self.format == "bf16" else torch.float32
            self.ms = [torch.zeros(s, dtype=dt) for s in sizes]
            self.vs = [torch.zeros(s, dtype=dt) for s in sizes]
        gdt = torch.float32 if config == "fp32" else torch.bfloat16
        self.grads = [fill(torch.empty(s, dtype=gdt), 0.01) for s in sizes]
        self.outs = [None] * len(sizes) if config == "fp32" else [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        # The peers take fp32 gradients only (see the module doc); bf16_states' peers step bf16 ones (self.grads).
        no_fp32_grads = config == "bf16_states" or (config == "8bit_states" and n > FORMAT_PEERS_UP_TO)
        self.fp32_grads = (self.grads if config == "fp32" else None if no_fp32_grads
                           else [fill(torch.empty(s), 0.01) for s in sizes])


class Impl:
    """One implementation over the shared arrays; `step()` runs one timed step."""

    name = ""

    def step(self) -> None:
        raise NotImplementedError


class Tierflow(Impl):
    name = "tierflow"

    def __init__(self, a: Arrays, threads: int) -> None:
        self.rt = tierflow._C.Runtime({"cpu_threads": str(threads), "host_memory": "90%"})
        self.a = a
        self.opts = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False,
                         maximize=False, decoupled_weight_decay=True)
        self.n = 0

    def step(self) -> None:
        self.n += 1
        a = self.a
        self.rt.adam_step(self.opts, self.n, a.masters, a.ms, a.vs, [None] * len(a.ms), a.grads, a.outs)


class TierflowFp32States(Tierflow):
    """tierflow with fp32 moments over a packed configuration's masters, gradients and copy-outs (its own m and
    v): the same step as bf16_mixed, timed in the same rounds as the packed format, so that the format's speed
    over fp32 moments is a ratio within rounds, not across minutes of drifting bandwidth."""

    name = "tierflow_fp32_states"

    def __init__(self, a: Arrays, threads: int) -> None:
        super().__init__(a, threads)
        self.ms = [torch.zeros(m.numel()) for m in a.masters]
        self.vs = [torch.zeros(m.numel()) for m in a.masters]

    def step(self) -> None:
        self.n += 1
        a = self.a
        self.rt.adam_step(self.opts, self.n, a.masters, self.ms, self.vs, [None] * len(self.ms), a.grads, a.outs)


class Roofline(Impl):
    """The traffic kernel over the same arrays, with the same threads."""

    name = "roofline"

    def __init__(self, a: Arrays, threads: int) -> None:
        self.a = a
        self.threads = threads

    def step(self) -> None:
        a = self.a
        tierflow._C.adam_traffic(a.masters, a.ms, a.vs, a.grads, a.outs, self.threads, 1)


class Peer(Impl):
    """torch.optim.AdamW (fused / foreach) or DeepSpeedCPUAdam, like with like (see the module doc)."""

    def __init__(self, name: str, a: Arrays, make_opt, tensor_step: bool) -> None:
        self.name = name
        self.a = a
        # Parameters that are views of the shared masters, with the shared state.
        self.params = [torch.nn.Parameter(m) for m in a.masters]
        for p, g in zip(self.params, a.fp32_grads):
            p.grad = g
        # One group per tensor: foreach temporaries stay per group, as memory allows at 1e9.
        self.opt = make_opt([{"params": [p]} for p in self.params])
        for p, m, v in zip(self.params, a.ms, a.vs):
            step = torch.tensor(0.0) if tensor_step else 0
            self.opt.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        self.copies = [(o, p) for o, p in zip(a.outs, self.params) if o is not None]

    def step(self) -> None:
        self.opt.step()
        for c, p in self.copies:
            c.copy_(p.detach())


class FormatPeer(Impl):
    """A peer of a packed format, stepping its own states over the shared arrays (so all fit at 1e9):
    bitsandbytes' or torchao's AdamW8bit on the fp32 masters with fp32 gradients, DeepSpeedCPUAdam or torch's
    fused AdamW on the bf16 copy-outs with the bf16 gradients, with bf16 states (see the module doc)."""

    def __init__(self, name: str, a: Arrays, make_opt) -> None:
        self.name = name
        pairs = (zip(a.outs, a.grads) if a.format == "bf16" else zip(a.masters, a.fp32_grads))
        self.params = []
        for w, g in pairs:
            p = torch.nn.Parameter(w)
            p.grad = g
            self.params.append(p)
        self.opt = make_opt([{"params": [p]} for p in self.params])

    def step(self) -> None:
        self.opt.step()


# The packed formats' peers run up to this size: the 8-bit ones step on the CPU 40x slower than tierflow at 1e8
# elements (bitsandbytes' and torchao's CPU paths), so their rounds would take minutes at 1e9; and beside the
# shared arrays and the fp32-moment step's moments, no peer's states fit this machine's 24 GiB at 1e9. The
# larger rows say why they are absent.
FORMAT_PEERS_UP_TO = int(1e8)


# Where `make bench` installs bitsandbytes and torchao: outside .venv, since torchao there breaks peft's import
# (peft's LoRA imports torchao names that torchao 0.18 no longer has).
PEERS_DIR = os.path.join(ROOT, "build", "bench-peers")


def format_peers(config: str, a: Arrays) -> tuple[list, dict]:
    """The peers of a packed-moment configuration that install here, and why the others do not."""
    makers, errors = [], {}
    if os.path.isdir(PEERS_DIR) and PEERS_DIR not in sys.path:
        sys.path.append(PEERS_DIR)
    n = sum(m.numel() for m in a.masters)
    if n > FORMAT_PEERS_UP_TO:
        why = (f"not run above {FORMAT_PEERS_UP_TO:.0e} elements: their states do not fit beside the shared arrays "
               "in this machine's memory" + (" (and they are 40x slower than tierflow at 1e8 on this CPU)"
                                             if config == "8bit_states" else ""))
        names = ("bitsandbytes_8bit", "torchao_8bit") if config == "8bit_states" else ("torch_fused_bf16",
                                                                                         "deepspeed_bf16")
        return [], {k: why for k in names}
    if config == "8bit_states":
        try:
            import bitsandbytes as bnb
            makers.append(("bitsandbytes_8bit", lambda: FormatPeer(
                "bitsandbytes_8bit", a, lambda g: bnb.optim.AdamW8bit(g, lr=1e-3, weight_decay=0.01))))
        except Exception as e:  # noqa: BLE001  reported, not hidden
            errors["bitsandbytes_8bit"] = f"import bitsandbytes failed: {type(e).__name__}: {e}"
        try:
            from torchao.optim import AdamW8bit
            makers.append(("torchao_8bit", lambda: FormatPeer(
                "torchao_8bit", a, lambda g: AdamW8bit(g, lr=1e-3, weight_decay=0.01))))
        except Exception as e:  # noqa: BLE001
            errors["torchao_8bit"] = f"import torchao failed: {type(e).__name__}: {e}"
    elif config == "bf16_states":
        makers.append(("torch_fused_bf16", lambda: FormatPeer(
            "torch_fused_bf16", a, lambda g: torch.optim.AdamW(g, lr=1e-3, weight_decay=0.01, fused=True))))
        ds_make, ds_info = deepspeed_factory(fp32_states=False)
        if ds_make is not None:
            makers.append(("deepspeed_bf16", lambda: FormatPeer("deepspeed_bf16", a, ds_make)))
        else:
            errors["deepspeed_bf16"] = ds_info
    return makers, errors


def deepspeed_factory(fp32_states: bool = True):
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001  reported, not hidden
        return None, f"import deepspeed failed: {type(e).__name__}: {e}"
    return (lambda groups: DeepSpeedCPUAdam(groups, lr=1e-3, weight_decay=0.01, adamw_mode=True,
                                            fp32_optimizer_states=fp32_states)), f"deepspeed {deepspeed.__version__}"


def measure(impls: list, rounds: int) -> dict:
    """Round-robin over the implementations, so every one sees the same machine: each round steps each once."""
    times = {i.name: [] for i in impls}
    for i in impls:
        i.step()  # warm-up (DeepSpeed compiles its op here on first use)
    for _ in range(rounds):
        for i in impls:
            t0 = time.perf_counter()
            i.step()
            times[i.name].append(time.perf_counter() - t0)
    return times


def run_config(n: int, config: str, threads: int, rounds: int) -> dict:
    ds_make, ds_info = deepspeed_factory()
    a = Arrays(n, config)
    if config in STATE_FORMATS:
        makers, errors = format_peers(config, a)
        makers.insert(0, ("tierflow_fp32_states", lambda: TierflowFp32States(a, threads)))
        return run_impls(a, threads, rounds, makers, errors, ds_info)
    makers = [
        ("torch_fused", lambda: Peer("torch_fused", a,
                                     lambda g: torch.optim.AdamW(g, lr=1e-3, weight_decay=0.01, fused=True), True)),
        ("torch_foreach", lambda: Peer("torch_foreach", a,
                                       lambda g: torch.optim.AdamW(g, lr=1e-3, weight_decay=0.01, foreach=True), True)),
    ]
    if ds_make is not None:
        makers.append(("deepspeed", lambda: Peer("deepspeed", a, ds_make, False)))
    errors = {} if ds_make is not None else {"deepspeed": ds_info}
    return run_impls(a, threads, rounds, makers, errors, ds_info)


def run_impls(a: Arrays, threads: int, rounds: int, makers: list, errors: dict, ds_info: str) -> dict:
    tf = Tierflow(a, threads)
    impls = [tf, Roofline(a, threads)]
    for name, make in makers:
        try:
            impls.append(make())
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
    times = measure(impls, rounds)
    isa = tf.rt.stats()["optimizer"]["isa"]
    return {"times": times, "errors": errors, "isa": isa, "deepspeed": ds_info}


PEER_CONFIGURATION = {
    "fp32": "the same configuration",
    "bf16_mixed": ("fp32 step, then a copy of the fp32 parameters into bf16 (peers keep no fp32 master for bf16 "
                   "parameters and take no bf16 gradients for fp32 ones)"),
    "8bit_states": ("8-bit moments on fp32 parameters and fp32 gradients, no separate master and no 16-bit copy-out "
                    "(about 14 bytes a parameter against tierflow's 16.06)"),
    "bf16_states": ("bf16 parameters, gradients and moments, no fp32 master (14 bytes a parameter against "
                    "tierflow's 20)"),
}
PEERS = ("roofline", "tierflow_fp32_states", "torch_fused", "torch_foreach", "deepspeed", "bitsandbytes_8bit", "torchao_8bit",
         "torch_fused_bf16", "deepspeed_bf16")


def ratios(times: dict) -> dict:
    """tierflow's speed over each other's, from the seconds of every round.

    The headline ratio is the median over rounds of the two steps' ratio in
    that round (taken moments apart), which the machine's drift from one round
    to the next does not bias; the ratio of the two best rounds, which may come
    from different moments, is kept beside it.
    """
    out = {}
    mine = times["tierflow"]
    for other in PEERS:
        if other not in times:
            continue
        r = sorted(t / m for m, t in zip(mine, times[other]))  # above 1: tierflow was faster
        out[f"tierflow_over_{other}"] = r[len(r) // 2]
        out[f"tierflow_over_{other}_per_round_min_median_max"] = [r[0], r[len(r) // 2], r[-1]]
        out[f"tierflow_over_{other}_best_rounds"] = min(times[other]) / min(mine)
    return out


def format_summary(results: list) -> list:
    """Per size: each packed format's speed over fp32 moments' in the same mixed configuration (bf16 gradients
    and copy-out; the median of per-round ratios against tierflow_fp32_states, and the ratio to the bf16_mixed
    row's best round, measured minutes apart), its fraction of its own roofline, its host state a parameter,
    and over its best peer."""
    out = []
    for n in sorted({r["elements"] for r in results}):
        rows = {r["config"]: r for r in results if r["elements"] == n}
        base = rows.get("bf16_mixed")
        for config in STATE_FORMATS:
            r = rows.get(config)
            if r is None:
                continue
            peers = r["peers_params_per_s"]
            best = max(peers, key=peers.get) if peers else None
            out.append({
                "elements": n, "optimizer_states": STATE_FORMATS[config],
                # within rounds: tierflow's fp32-moment step over the same arrays, timed beside it
                "over_fp32_states": r.get("tierflow_over_tierflow_fp32_states"),
                "over_fp32_states_per_round_min_median_max":
                    r.get("tierflow_over_tierflow_fp32_states_per_round_min_median_max"),
                "over_bf16_mixed_row": (r["tierflow_params_per_s"] / base["tierflow_params_per_s"]
                                        if base else None),
                "of_own_roofline": r["of_own_roofline"],
                "host_state_bytes_per_param": r["host_state_bytes_per_param"],
                "best_peer": best,
                "over_best_peer": r["tierflow_params_per_s"] / peers[best] if best else None,
            })
    return out


def compute_ceiling(steps: int = 300) -> dict:
    """Each format's step rate on one thread over 2^19 elements (one chunk: one thread; in the last-level cache,
    so memory hardly bounds it): its compute ceiling a core, bf16 gradients and copy-out. A machine whose
    memory floor a core (bandwidth / bytes a parameter / cores) lies below this is memory-bound in that format;
    gpu_offload_predict.py takes these to predict the CPU step on a node of many cores."""
    n = 1 << 19
    rt = tierflow._C.Runtime({"cpu_threads": "1", "host_memory": "90%"})
    opts = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
                decoupled_weight_decay=True)
    master, grad, out = fill(torch.empty(n), 0.5), fill(torch.empty(n, dtype=torch.bfloat16), 0.01), \
        torch.empty(n, dtype=torch.bfloat16)
    rates = {}
    for fmt in ("fp32", "bf16", "8bit"):
        if fmt == "8bit":
            m, v = (torch.zeros(tierflow._C.moment_bytes("8bit", n), dtype=torch.uint8) for _ in range(2))
        else:
            m, v = (torch.zeros(n, dtype=torch.float32 if fmt == "fp32" else torch.bfloat16) for _ in range(2))
        best = float("inf")
        for rep in range(3):
            t0 = time.perf_counter()
            for i in range(steps):
                rt.adam_step(opts, rep * steps + i + 1, [master], [m], [v], [None], [grad], [out])
            best = min(best, time.perf_counter() - t0)
        rates[fmt] = n * steps / best
    return {"elements": n, "threads": 1, "params_per_s_per_thread": rates}


def main() -> int:
    ap = argparse.ArgumentParser(description="CPU Adam benchmark")
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e8, 1e9])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7, help="timed steps of each implementation, round-robin")
    ap.add_argument("--configs", nargs="+", default=["fp32", "bf16_mixed", "bf16_states", "8bit_states"],
                    choices=["fp32", "bf16_mixed", "bf16_states", "8bit_states"])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "optimizer.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    results = []
    ceiling = args.ceiling = compute_ceiling()
    print("compute ceiling a thread (2^19 elements, in cache):",
          ", ".join(f"{k} {v:.3e}/s" for k, v in ceiling["params_per_s_per_thread"].items()), flush=True)
    for size in args.sizes:
        n = int(size)
        for config in args.configs:
            r = run_config(n, config, args.threads, args.rounds)
            gc.collect()  # the arrays of this configuration go before the next one's
            t = r["times"]
            rate = {k: n / min(v) for k, v in t.items()}  # best round of each
            row = {
                "elements": n, "config": config, "threads": args.threads, "isa": r["isa"], "rounds": args.rounds,
                "tierflow_params_per_s": rate["tierflow"],
                "roofline_params_per_s": rate["roofline"],
                "torch_fused_params_per_s": rate.get("torch_fused"),
                "torch_foreach_params_per_s": rate.get("torch_foreach"),
                "deepspeed_params_per_s": rate.get("deepspeed"),
                "peers_params_per_s": {k: v for k, v in rate.items()
                                       if k not in ("tierflow", "roofline", "tierflow_fp32_states")},
                "tierflow_fp32_states_params_per_s": rate.get("tierflow_fp32_states"),
                "deepspeed": r["deepspeed"],
                "optimizer_states": STATE_FORMATS.get(config, "fp32"),
                "traffic_bytes_per_param": TRAFFIC_BYTES[config],
                "host_state_bytes_per_param": STATE_BYTES[config],
                "of_own_roofline": rate["tierflow"] / rate["roofline"],
                "errors": r["errors"],
                "peer_configuration": PEER_CONFIGURATION[config],
                "seconds_per_round": {k: v for k, v in t.items()},
            }
            row.update(ratios(t))
            row["roofline_gbps"] = TRAFFIC_BYTES[config] * rate["roofline"] / 1e9
            results.append(row)
            fmt = lambda x: f"{x:.3e}" if x else "n/a"  # noqa: E731
            print(f'{n:.0e} {config:10s} tierflow {fmt(rate["tierflow"])}/s  roofline {fmt(rate["roofline"])}/s  '
                  f'torch fused {fmt(rate.get("torch_fused"))}  foreach {fmt(rate.get("torch_foreach"))}  '
                  f'deepspeed {fmt(rate.get("deepspeed"))}', flush=True)
            for other in PEERS:
                if other in rate:
                    lo, med, hi = row[f"tierflow_over_{other}_per_round_min_median_max"]
                    print(f'    x {other:13s} {med:.3f} (median of rounds; min {lo:.3f}, max {hi:.3f}; '
                          f'best round over best round {row[f"tierflow_over_{other}_best_rounds"]:.3f})', flush=True)
            write_results(args, results)

    write_results(args, results)
    print("wrote", args.out)
    return 0


def write_results(args: argparse.Namespace, results: list) -> None:
    """The JSON of the rows so far (written after each row: a run killed later keeps what it measured)."""
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
        "state_formats": format_summary(results),
        "compute_ceiling": args.ceiling,
        "results": results,
    }
    write_json_atomic(args.out, out)


if __name__ == "__main__":
    sys.exit(main())
