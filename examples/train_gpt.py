"""tierflow's demo: train a small GPT twice, without and with tierflow, and show where memory went.

Both runs use the same model, data and seed. The first is plain PyTorch with
torch.optim.AdamW; the second is the same code after one line,
``model, optimizer = tierflow.wrap(model, optimizer)``, with a device budget
(``--gpu-memory``) below what the model's saved activations need: the
activation planner (TIERFLOW_OFFLOAD_ACTIVATIONS=auto) profiles the first two
steps and then keeps, swaps to the pinned host tier, splits by tokens or
recomputes each block so that the step fits; AdamW steps on the CPU from fp32
master weights. Run it with ``make demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tierflow  # noqa: E402
from gpt import GPT, CharData, GPTConfig, gpt_loss, make_text  # noqa: E402
from tierflow._report import fmt_bytes  # noqa: E402


def train(use_tierflow: bool, args: argparse.Namespace, data: CharData) -> dict:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=data.vocab_size, block_size=args.block, n_layer=args.layers,
                    n_head=4, n_embd=args.width, dropout=0.1)
    model = GPT(cfg).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    meter = None
    if use_tierflow:
        nvme = dict(offload_activations="nvme", offload_optimizer="nvme", nvme_paths=args.nvme,
                    nvme_memory="4GiB") if args.nvme else {}
        model, optimizer = tierflow.wrap(model, optimizer, prefetch_bytes=args.prefetch, gpu_memory=args.gpu_memory,
                                         device="cuda" if args.device == "cuda" else "emulated", **nvme)
    else:
        meter = tierflow.SavedActivationMeter()  # counts saved bytes, moves nothing
    gen = torch.Generator().manual_seed(args.seed)
    losses, times = [], []
    for _ in range(args.steps):
        x, y = data.batch(args.batch, gen)
        x, y = x.to(args.device), y.to(args.device)
        t0 = time.perf_counter()
        if meter is not None:
            meter.begin_forward()
            with meter.hooks():
                loss = gpt_loss(model, x, y)
        else:
            loss = gpt_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    result = {"losses": losses, "step_s": times}
    if use_tierflow:
        result["report"] = tierflow.report()
        result["nvme_adam"] = dict(tierflow.current_session().runtime.nvme_adam_stats())
        plan = result["report"].get("plan", {})
        # The offloader's blocks plus the blocks the plan keeps (never handed to the offloader).
        result["saved_peak_bytes"] = result["report"]["activations"]["device_bytes"]["peak"] + \
            plan.get("kept_bytes", 0)
    else:
        result["saved_peak_bytes"] = meter.peak_bytes
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefetch", default="8MiB", help="TIERFLOW_PREFETCH_BYTES for the demo")
    ap.add_argument("--gpu-memory", default="64MiB",
                    help="TIERFLOW_GPU_MEMORY for the demo: below what its saved activations need (default 64MiB)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--device", default="", help="cuda or cpu (default: cuda when tierflow and torch see a GPU; "
                                                 "cpu trains on tierflow's emulated device)")
    ap.add_argument("--nvme", default="", help="a directory on an NVMe file system: activations and "
                                               "optimizer states go there (the NVMe tier)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if not args.device:
        args.device = "cuda" if torch.cuda.is_available() and tierflow._C.cuda_available() else "cpu"
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device {args.device!r}: accepted: cuda, cpu")

    data = CharData(make_text(), args.block)
    print(f"tierflow demo: GPT {args.layers} layers x {args.width} wide, batch {args.batch} x {args.block} "
          f"tokens, {args.steps} steps, device: {'cuda' if args.device == 'cuda' else 'emulated'}")
    base = train(False, args, data)
    tier = train(True, args, data)

    print("\nstep   loss (PyTorch)   loss (tierflow)   |diff|")
    worst = 0.0
    for i, (a, b) in enumerate(zip(base["losses"], tier["losses"])):
        worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
        print(f"{i:4d}   {a:14.6f}   {b:15.6f}   {abs(a - b):.2e}")
    print(f"largest relative loss difference: {worst:.2e}")

    def mean_ms(t: list) -> float:
        tail = t[2:] if len(t) > 4 else t
        return 1000.0 * sum(tail) / len(tail)

    b_peak, t_peak = base["saved_peak_bytes"], tier["saved_peak_bytes"]
    print("\nwhere memory went")
    print(f"  device bytes held by saved activations, peak:  PyTorch {fmt_bytes(b_peak)}   "
          f"tierflow {fmt_bytes(t_peak)}   ({100.0 * t_peak / max(b_peak, 1):.1f}% of PyTorch's)")
    plan = tier["report"].get("plan")
    if plan:
        print(f"  activation plan (TIERFLOW_GPU_MEMORY={args.gpu_memory}): {plan['summary']}")
    link = tier["report"]["links"]
    if args.nvme:
        nv = tier["report"]["activations"]["nvme"]
        opt = tier["nvme_adam"]
        print(f"  NVMe: activations written {fmt_bytes(nv['write_bytes'])} in {nv['writes']} blocks, read back "
              f"{nv['reads']}; optimizer states read {fmt_bytes(opt.get('bytes_read', 0))}, written "
              f"{fmt_bytes(opt.get('bytes_written', 0))}")
    print(f"  moved gpu->host {fmt_bytes(link['gpu_to_host_bytes'])}, host->gpu {fmt_bytes(link['host_to_gpu_bytes'])}")
    print(f"  step time (mean after warm-up): PyTorch {mean_ms(base['step_s']):.1f} ms, "
          f"tierflow {mean_ms(tier['step_s']):.1f} ms")
    print()
    print(tier["report"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": {k: v for k, v in base.items()},
                       "tierflow": {k: v for k, v in tier.items()}}, f, indent=2, default=dict)
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
