"""DDP with tierflow's CPU AdamW: partitioned across the ranks (TIERFLOW_PARTITION_OPTIMIZER=on) against every rank
stepping every parameter (off).

    PYTHONPATH=bindings/python .venv/bin/python benchmarks/bench_ddp_optimizer.py [--params 5e7] [--ranks 2]

Starts ``--ranks`` gloo processes on this machine. Each trains the same model (``--blocks`` linear blocks of
``--width``, about ``--params`` parameters) under DDP, wrapped by tierflow (activations kept, the CPU AdamW
stepping during backward from DDP's reduced gradients), in rounds: each round builds the run afresh once with the
partitioned optimizer and once without, in alternating order so that the machine's load falls on both alike, and
times ``--steps`` whole training steps (forward, backward, step(), each begun together on every rank). Per rank it
records the median step time of each setting, the optimizer states it holds (elements per moment), the host pool's
bytes in use after the steps, and the partitioned run's weight broadcasts; the losses of the two settings, which
must be equal bit for bit (Note [Partitioned optimizer]). The ratio is the unpartitioned step time over the
partitioned one (above 1: partitioning pays in time too); the states' ratio is what each rank saves in memory.
Writes benchmarks/results/ddp_optimizer.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gloo_ranks import run_ranks  # noqa: E402

SETTINGS = ("partitioned", "unpartitioned")


def _model(blocks: int, width: int) -> torch.nn.Module:
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(blocks)]
    return torch.nn.Sequential(*layers)


def _run(args: argparse.Namespace, setting: str) -> dict:
    """One run of ``setting``: warm-up and timed steps; what it measured."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tierflow

    torch.manual_seed(0)
    model = _model(args.blocks, args.width)
    net, opt = tierflow.wrap(DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01),
                             device="emulated", offload_activations="none", offload_optimizer="host",
                             cpu_threads=args.threads,
                             partition_optimizer="on" if setting == "partitioned" else "off")
    seconds, losses = [], []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * step + args.rank)
        x = torch.randn(args.batch, args.width, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        took = time.perf_counter() - t0
        losses.append(loss.item())
        if step >= args.warmup:
            seconds.append(took)
    report = tierflow.report()
    out = {"seconds": seconds, "losses": losses,
           "state_elements_per_moment": sum(s["exp_avg"].numel() for s in opt.state.values() if "exp_avg" in s),
           "host_in_use_bytes": report["host_pool"]["in_use"]["current"],
           "overlap": dict(opt.overlap_stats), "partition": opt.partition_stats()}
    tierflow.unwrap(net)
    del net, opt, model
    return out


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + args.store, rank=args.rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(args.threads)
    rounds = []
    for r in range(args.rounds):
        order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
        rounds.append({setting: _run(args, setting) for setting in order})
    with open(args.worker_out, "w") as f:
        json.dump({"rank": args.rank, "rounds": rounds}, f)
    dist.barrier()
    dist.destroy_process_group()
    # torch's gloo may abort at interpreter exit once broadcasts ran beside DDP's all-reduces (without tierflow
    # too); the results are written: leave without the teardown.
    sys.stdout.flush()
    os._exit(0)


def _summary(rank: dict) -> dict:
    rounds = rank["rounds"]
    step = {s: statistics.median([t for r in rounds for t in r[s]["seconds"]]) for s in SETTINGS}
    last = rounds[-1]
    part = last["partitioned"]["partition"] or {}
    return {"rank": rank["rank"], "step_seconds": step,
            "unpartitioned_over_partitioned_step": step["unpartitioned"] / step["partitioned"],
            "state_elements_per_moment": {s: last[s]["state_elements_per_moment"] for s in SETTINGS},
            "host_in_use_bytes": {s: last[s]["host_in_use_bytes"] for s in SETTINGS},
            "broadcast_ms_per_step": part.get("broadcast_host_ms", 0.0) / max(part.get("broadcasts", 0), 1),
            "losses_equal": all(r["partitioned"]["losses"] == r["unpartitioned"]["losses"] for r in rounds),
            "redone": {s: last[s]["overlap"]["redone"] for s in SETTINGS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=5e7, help="parameters in all (about)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating which goes first")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ddp_optimizer.json"))
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.blocks = max(1, round(args.params / (args.width * args.width + args.width)))
    if args.rank is not None:
        _worker(args)
        return
    if args.ranks < 2 or args.steps < 1 or args.threads < 1 or args.rounds < 1:
        ap.error("--ranks must be at least 2 (partitioning needs several); --steps, --threads, --rounds at least 1")
    ranks = run_ranks(__file__, args, ("params", "width", "ranks", "threads", "batch", "steps", "warmup", "rounds"))
    summaries = [_summary(r) for r in ranks]
    parameters = sum(p.numel() for p in _model(args.blocks, args.width).parameters())
    states = [s["state_elements_per_moment"]["partitioned"] for s in summaries]
    result = {
        "benchmark": "DDP training step with tierflow's CPU AdamW: partitioned across the ranks vs unpartitioned",
        "config": {k: getattr(args, k) for k in ("params", "width", "blocks", "ranks", "threads", "batch", "steps",
                                                  "warmup", "rounds")},
        "parameters": parameters,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "per_rank": summaries,
        "unpartitioned_over_partitioned_step": statistics.median(
            s["unpartitioned_over_partitioned_step"] for s in summaries),
        "partitioned_states_one_copy": sum(states) == parameters,
        "unpartitioned_states_per_rank_over_partitioned": statistics.median(
            s["state_elements_per_moment"]["unpartitioned"] / max(s["state_elements_per_moment"]["partitioned"], 1)
            for s in summaries),
        "losses_equal": all(s["losses_equal"] for s in summaries),
        "raw": ranks,
        "note": "step: forward + backward + step() of DDP on the emulated device (gloo, the model's tensors on the "
                "CPU), median over the timed steps of every round; above 1: the partitioned optimizer is faster",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from tierflow._report import write_json_atomic

    write_json_atomic(args.out, result)
    for s in summaries:
        st, states = s["step_seconds"], s["state_elements_per_moment"]
        print(f"rank {s['rank']}: step partitioned {st['partitioned']:.4f} s, unpartitioned "
              f"{st['unpartitioned']:.4f} s (x{s['unpartitioned_over_partitioned_step']:.2f}); states per moment "
              f"{states['partitioned']:,} vs {states['unpartitioned']:,}; broadcast "
              f"{s['broadcast_ms_per_step']:.1f} ms a step; losses equal: {s['losses_equal']}")
    print(f"unpartitioned / partitioned step x{result['unpartitioned_over_partitioned_step']:.2f}; states one copy on "
          f"the node: {result['partitioned_states_one_copy']}; losses equal: {result['losses_equal']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
