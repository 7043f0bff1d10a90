"""Fine-tune a transformers GPT-2 with fp32, bf16 and 8-bit AdamW moments (issue 39): is the loss the same?

TIERFLOW_OPTIMIZER_STATES (keyword ``optimizer_states=``) stores the CPU AdamW's
exp_avg and exp_avg_sq as fp32, bf16 or 8-bit block-wise codes (Note [Optimizer
state formats]). The formats are not bit for bit alike, so their effect is a
question of accuracy: this study trains the same model on the same data, with
each format and several seeds, exactly as a user would (``tierflow.wrap(model,
torch.optim.AdamW(...), optimizer_states=...)``), and asks whether each
format's final loss lies within fp32's seed-to-seed spread.

The model is ``transformers.GPT2LMHeadModel(GPT2Config(...))`` with GPT2Config's
defaults (dropout 0.1, GELU, layer norm eps, initializer range) except its
size: n_layer, n_embd, n_head, n_positions, and vocab_size (the characters of
the text). The text is the demo's (examples/gpt.py ``make_text``: generated
sentences about arithmetic), character level. The seed sets the weights'
initialisation, the batches and dropout, so a seed's runs with different
formats see the same data in the same order: their difference is the format's.

Each run is its own process (one session each), with one intra-op thread and
TIERFLOW_CPU_THREADS=1, one after another; the device is the emulated one
(TIERFLOW_DEVICE=emulated, TIERFLOW_EMULATED_DEVICE=polite unless set).

    PYTHONPATH=bindings/python .venv/bin/python benchmarks/finetune_states.py

writes benchmarks/results/finetune_states.json and docs/finetune_states.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ("fp32", "bf16", "8bit")
MOMENT_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "8bit": "uint8"}
# The final loss is the mean of the last FINAL_WINDOW steps' losses; the curves
# compared are trailing means over the same window (one batch's loss is noisy).
FINAL_WINDOW = 20
# GPT2Config fields set here; every other field keeps its default.
MODEL_SIZE = dict(n_layer=2, n_embd=128, n_head=4, n_positions=128)


def one_run(fmt: str, seed: int, args: argparse.Namespace) -> dict:
    """Trains one model with moments in `fmt`; returns its losses and wall time."""
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import tierflow
    from gpt import CharData, make_text

    torch.set_num_threads(1)
    data = CharData(make_text(), args.block)
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=data.vocab_size, **MODEL_SIZE)
    model = transformers.GPT2LMHeadModel(config)
    model.config.use_cache = False  # training: no key/value cache (tierflow.wrap says so otherwise)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, optimizer = tierflow.wrap(model, optimizer, optimizer_states=fmt, device="emulated")
    gen = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x, y = data.batch(args.batch, gen)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    wall_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    # What the CPU AdamW keeps: the format of a moment is its dtype (Note [Optimizer state formats]).
    moment_dtypes = sorted({str(st[k].dtype).replace("torch.", "") for st in optimizer.state.values()
                            for k in ("exp_avg", "exp_avg_sq") if k in st})
    # Which path stepped: during backward (the gradient stream; committed) or in step().
    overlap = {k: v for k, v in optimizer.overlap_stats.items() if k in ("early_steps", "committed", "redone")}
    tierflow.unwrap(model)
    return {"format": fmt, "seed": seed, "moment_dtypes": moment_dtypes, "stepped_during_backward": overlap,
            "losses": losses, "wall_s": wall_s, "parameters": n_params,
            "final_loss": sum(losses[-FINAL_WINDOW:]) / len(losses[-FINAL_WINDOW:])}


def trailing_mean(xs: list, window: int) -> list:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def mean_curve(curves: list) -> list:
    return [sum(c[i] for c in curves) / len(curves) for i in range(len(curves[0]))]


def summarize(runs: list, formats: list) -> dict:
    """fp32's seed spread, each format's final loss against it, and the curves' largest gap."""
    by_fmt = {f: sorted((r for r in runs if r["format"] == f), key=lambda r: r["seed"]) for f in formats}
    ref = by_fmt["fp32"]
    finals = [r["final_loss"] for r in ref]
    lo, hi = min(finals), max(finals)
    spread = hi - lo
    smooth = {f: [trailing_mean(r["losses"], FINAL_WINDOW) for r in rs] for f, rs in by_fmt.items()}
    ref_mean = mean_curve(smooth["fp32"])
    # fp32's seed spread at each step (max - min over seeds of the smoothed curves).
    ref_band = [(min(c[i] for c in smooth["fp32"]), max(c[i] for c in smooth["fp32"])) for i in range(len(ref_mean))]
    out = {"fp32_final_min": lo, "fp32_final_max": hi, "fp32_final_spread": spread,
           # A run drawn from fp32's own distribution of final losses lies outside the min..max of
           # n fp32 seeds with probability 2/(n+1): the yardstick of "within the spread" is coarse.
           "chance_outside_if_same_distribution": 2 / (len(finals) + 1),
           "final_window_steps": FINAL_WINDOW, "formats": {}}
    for f, rs in by_fmt.items():
        f_finals = [r["final_loss"] for r in rs]
        f_mean = mean_curve(smooth[f])
        # From step FINAL_WINDOW on: before that the trailing mean covers fewer steps.
        steps = range(FINAL_WINDOW - 1, len(f_mean))
        gaps = [abs(f_mean[i] - ref_mean[i]) for i in steps]
        ratios = [abs(f_mean[i] - ref_mean[i]) / max(ref_band[i][1] - ref_band[i][0], 1e-12) for i in steps]
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        paired = [a["final_loss"] - b["final_loss"] for a, b in zip(rs, ref)]
        out["formats"][f] = {
            "final_losses": {str(r["seed"]): r["final_loss"] for r in rs},
            "final_mean": sum(f_finals) / len(f_finals),
            "finals_within_fp32_spread": [lo <= x <= hi for x in f_finals],
            "all_within_fp32_spread": all(lo <= x <= hi for x in f_finals),
            "mean_within_fp32_spread": lo <= sum(f_finals) / len(f_finals) <= hi,
            "paired_final_diff_vs_fp32": {str(r["seed"]): d for r, d in zip(rs, paired)},
            "max_abs_gap_mean_curve_vs_fp32": max(gaps),
            "max_gap_over_final_fp32_spread": max(gaps) / max(spread, 1e-12),
            "max_gap_over_stepwise_fp32_spread": ratios[worst],
            "max_gap_over_stepwise_fp32_spread_at_step": steps[worst],
            "wall_s_mean": sum(r["wall_s"] for r in rs) / len(rs),
        }
    return out


def plot(runs: list, formats: list, path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fp32": "black", "bf16": "tab:blue", "8bit": "tab:red"}
    fig, (ax, axz, axf) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [3, 3, 2]})
    smooth = {f: [trailing_mean(r["losses"], FINAL_WINDOW) for r in runs if r["format"] == f] for f in formats}
    # From the first step whose trailing mean covers the whole window.
    first = min(FINAL_WINDOW, args.steps) - 1
    steps = list(range(first + 1, args.steps + 1))
    for a in (ax, axz):
        ref = smooth["fp32"]
        a.fill_between(steps, [min(c[i] for c in ref) for i in range(first, args.steps)],
                       [max(c[i] for c in ref) for i in range(first, args.steps)], color="0.8",
                       label="fp32 min..max over seeds")
        for f in formats:
            a.plot(steps, mean_curve(smooth[f])[first:], color=colors.get(f), lw=1.3,
                   ls="-" if f == "fp32" else "--", label=f"{f} mean of {len(smooth[f])} seeds")
        a.set_xlabel("step")
    ax.set_ylabel(f"training loss (trailing mean of {FINAL_WINDOW} steps)")
    ax.set_title("GPT-2 (transformers), 2 layers x 128, demo text")
    axz.set_xlim(args.steps * 0.5, args.steps)
    tail = [v for f in formats for c in smooth[f] for v in c[len(c) // 2:]]
    axz.set_ylim(min(tail) - 0.02, max(tail) + 0.02)
    axz.set_title("second half, zoomed")
    ax.legend(fontsize=8)
    # Each seed's final loss in each format: a seed's runs share weights' init, batches and dropout.
    finals = {(r["format"], r["seed"]): r["final_loss"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    ref_finals = [finals[("fp32", sd)] for sd in seeds]
    axf.axhspan(min(ref_finals), max(ref_finals), color="0.8", label="fp32 min..max")
    for sd in seeds:
        axf.plot(range(len(formats)), [finals[(f, sd)] for f in formats], marker="o", lw=0.8, label=f"seed {sd}")
    axf.set_xticks(range(len(formats)), formats)
    axf.set_xlim(-0.4, len(formats) - 0.6)
    axf.set_ylabel(f"final loss (mean of the last {FINAL_WINDOW} steps)")
    axf.set_title("final loss by seed")
    axf.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for each format")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated; fp32 is always run (the reference)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "finetune_states.json"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "finetune_states.png"), help="empty: no plot")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128, help="tokens a sequence (at most n_positions)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--from", dest="from_json", default="",
                    help="no training: summarize and plot the runs of this results JSON again (into --out, --plot)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # "fmt,seed": a child run, JSON on stdout
    args = ap.parse_args()
    if args.one:
        fmt, seed = args.one.split(",")
        print(json.dumps(one_run(fmt, int(seed), args)))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        result["summary"] = summarize(result["runs"], result["settings"]["formats"])
        args.steps = result["settings"]["steps"]
        return report(result, args)

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        ap.error(f"--formats {','.join(bad)}: accepted: {', '.join(FORMATS)}")
    formats = ["fp32"] + [f for f in formats if f != "fp32"]
    if not 1 <= args.block <= MODEL_SIZE["n_positions"]:
        ap.error(f"--block {args.block}: accepted: 1 to n_positions ({MODEL_SIZE['n_positions']})")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TIERFLOW_CPU_THREADS="1",
               TIERFLOW_DEVICE="emulated")
    env.setdefault("TIERFLOW_EMULATED_DEVICE", "polite")
    # A PYTHONPATH given first: a copy of the package can be measured while the tree rebuilds.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""),
                                                     os.path.join(ROOT, "bindings", "python")) if p)
    child_args = ["--steps", str(args.steps), "--batch", str(args.batch), "--block", str(args.block),
                  "--lr", repr(args.lr), "--weight-decay", repr(args.weight_decay)]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    runs = []
    t_all = time.perf_counter()
    for seed in range(args.seeds):
        for fmt in formats:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", f"{fmt},{seed}", *child_args],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                print(f"run {fmt} seed {seed} failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            if run["moment_dtypes"] != [MOMENT_DTYPE[fmt]]:
                print(f"run {fmt} seed {seed}: the CPU AdamW kept its moments as {run['moment_dtypes']}, not "
                      f"{MOMENT_DTYPE[fmt]}: optimizer_states={fmt} is not in effect", file=sys.stderr)
                return 1
            runs.append(run)
            print(f"{fmt:>5} seed {seed}: final loss {run['final_loss']:.4f}   {run['wall_s']:.1f} s", flush=True)

    summary = summarize(runs, formats)
    import torch
    import transformers

    result = {
        "what": __doc__.splitlines()[0],
        "model": {"class": "transformers.GPT2LMHeadModel", "config_changed": {**MODEL_SIZE, "vocab_size": "the text's "
                  "characters"}, "parameters": runs[0]["parameters"]},
        "data": "examples/gpt.py make_text(), character level",
        "settings": {"steps": args.steps, "batch": args.batch, "block": args.block, "lr": args.lr,
                     "weight_decay": args.weight_decay, "seeds": list(range(args.seeds)), "formats": formats,
                     "device": "emulated (" + env["TIERFLOW_EMULATED_DEVICE"] + ")", "threads": 1},
        "commit": commit,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "total_wall_s": time.perf_counter() - t_all,
        "summary": summary,
        "runs": runs,
    }
    return report(result, args)


def report(result: dict, args: argparse.Namespace) -> int:
    """Writes the results JSON and the plot, and prints the summary."""
    summary, runs, formats = result["summary"], result["runs"], result["settings"]["formats"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"fp32 final losses {summary['fp32_final_min']:.4f}..{summary['fp32_final_max']:.4f} "
          f"(spread {summary['fp32_final_spread']:.4f})")
    for fmt, s in summary["formats"].items():
        print(f"{fmt:>5}: final mean {s['final_mean']:.4f}, all within fp32's spread: {s['all_within_fp32_spread']}, "
              f"largest mean-curve gap {s['max_abs_gap_mean_curve_vs_fp32']:.4f} "
              f"({s['max_gap_over_final_fp32_spread']:.2f}x the final spread)")
    if args.plot:
        plot(runs, formats, args.plot, args)
        print(f"plot: {args.plot}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
