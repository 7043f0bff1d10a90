"""``python -m tierflow timeline TRACE -o step.png``: one step of a tierflow trace (TIERFLOW_TRACE, tierflow.trace)
drawn with matplotlib: the bytes per tier over time above one lane per kind of work (Note [Trace] in
core/include/tierflow/core/trace.hpp). ``--merge TORCH.json -o merged.json`` writes the trace and torch.profiler's
exported one as one file on one clock, for Perfetto. Torch-free: core reads the trace (Note [Trace file] in
core/include/tierflow/core/trace_file.hpp); this module draws.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from .. import _core  # the torch-free extension: the trace's reader (Note [Trace file] in core/trace_file.hpp)

# Colours per lane (by its thread_name without the prefix); the counters' series after.
LANE_COLOURS = {
    "steps": "#bbbbbb", "block forward": "#4c72b0", "block backward": "#dd8452", "block replay": "#c44e52",
    "copy device -> host": "#55a868", "copy host -> device": "#8172b3", "NVMe write": "#937860",
    "NVMe read": "#da8bc3", "CPU AdamW": "#ccb974", "CPU AdamW queue": "#e5dcaa", "other work": "#8c8c8c",
}
SERIES_COLOURS = {"device activations": "#4c72b0", "pinned host": "#55a868", "NVMe": "#937860"}
MiB = float(1 << 20)


class TimelineError(Exception):
    """A trace that cannot be read or drawn; the message names the file and what is wrong."""


def _read(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` of the C++ reader (core/trace_file.hpp), its JSON text as Python's; its refusals as
    TimelineError, with their words."""
    try:
        return json.loads(fn(*args))
    except (_core.ConfigError, _core.IOError) as e:
        raise TimelineError(str(e)) from None


def load(path: str) -> dict:
    """The Chrome trace at ``path`` (a JSON object with traceEvents, or a bare list of events)."""
    return _read(_core.trace_load_file, path)


def merge(tierflow_doc: dict, torch_doc: dict) -> dict:
    """One trace with both files' events on the earlier of their two bases (Note [Trace file])."""
    return _read(_core.trace_merge, json.dumps(tierflow_doc), json.dumps(torch_doc))


def merge_files(tierflow_path: str, torch_path: str, out_path: str) -> dict:
    """merge() of two files, written to ``out_path``; returns the merged trace."""
    return _read(_core.trace_merge_files, tierflow_path, torch_path, out_path)


def one_step(doc: dict, step: int = -1) -> dict:
    """The events of step ``step`` (Python's index: -1 the last; the picture names it 1-based, as step_stats and the
    trace's markers do): {"start", "end", "spans", "counters", "count", "index", "split"} (Note [Trace file]:
    ``split`` says what the steps were told apart by: "steps", "block forward" or "trace")."""
    s = _read(_core.trace_one_step, json.dumps(doc), step)
    s["counters"] = [tuple(c) for c in s["counters"]]
    return s


def draw(doc: dict, out_path: str, step: int = -1, title: Optional[str] = None) -> dict:
    """Draws one step to ``out_path`` (any format matplotlib writes: .png, .svg, .pdf); returns one_step()."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TimelineError("python -m tierflow timeline draws with matplotlib, which is not installed: "
                            "pip install matplotlib") from None
    s = one_step(doc, step)
    t0 = s["start"]
    ms = lambda us: (us - t0) / 1000.0  # noqa: E731
    order = [n for n in LANE_COLOURS if any(x["lane"] == n for x in s["spans"])]
    order += sorted({x["lane"] for x in s["spans"]} - set(order))
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(12, 2.2 + 0.45 * len(order) + 2.0),
                                      gridspec_kw={"height_ratios": [2.0, 0.45 * max(len(order), 1) + 0.3]})
    # Bytes per tier over time (a step function between readings).
    names = []
    for _, args in s["counters"]:
        names += [k for k in args if k not in names]
    for name in names:
        xs = [ms(t) for t, a in s["counters"]] + [ms(s["end"])]
        ys = [a.get(name, 0) / MiB for _, a in s["counters"]]
        if not ys:
            continue
        ys.append(ys[-1])
        top.step(xs, ys, where="post", label=name, color=SERIES_COLOURS.get(name), linewidth=1.6)
    top.set_ylabel("MiB held")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    if names:
        top.legend(loc="upper left", fontsize=8, ncol=len(names), frameon=False)
    took = (s["end"] - s["start"]) / 1000.0
    top.set_title(title or f"tierflow: step {s['index'] + 1} of {s['count']} ({took:.1f} ms)", fontsize=11)
    # One lane per kind of work (broken_barh), top to bottom in the recorder's order.
    width = ms(s["end"])
    for row, lane in enumerate(order):
        y = len(order) - 1 - row
        bars = [(ms(max(x["ts"], t0)), max((min(x["ts"] + x["dur"], s["end"]) - max(x["ts"], t0)) / 1000.0,
                                           width * 2e-3)) for x in s["spans"] if x["lane"] == lane]
        # Blocks run one at a time: a thin white edge tells neighbours apart. Work in flight overlaps: no edge,
        # so that a short copy stays visible.
        edge = dict(edgecolor="white", linewidth=0.6) if lane.startswith("block") or lane == "steps" else dict(
            edgecolor="none")
        bottom.broken_barh(bars, (y - 0.38, 0.76), facecolors=LANE_COLOURS.get(lane, "#8c8c8c"), **edge)
        if lane == "steps":  # the step's name ("step 3") on its bar
            for x, (left, w) in zip([x for x in s["spans"] if x["lane"] == lane], bars):
                if w > width * 0.05:
                    bottom.text(left + w / 2, y, x["name"], ha="center", va="center", fontsize=7, color="black")
        if lane.startswith("block"):  # the block's index on bars wide enough to read it
            for x, (left, w) in zip([x for x in s["spans"] if x["lane"] == lane], bars):
                if w > width * 0.018 and "block" in x["args"]:
                    bottom.text(left + w / 2, y, str(x["args"]["block"]), ha="center", va="center", fontsize=7,
                                color="white")
    bottom.set_yticks(range(len(order)))
    bottom.set_yticklabels(list(reversed(order)), fontsize=9)
    bottom.set_ylim(-0.6, len(order) - 0.4)
    bottom.set_xlim(0, width)
    bottom.set_xlabel({"steps": "ms from the step's start (its first forward)",
                       "block forward": "ms from the step's first block forward",
                       "trace": "ms from the trace's first event"}[s["split"]])
    bottom.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return s


def timeline_command(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tierflow timeline", description=__doc__.strip().split("\n\n")[0])
    p.add_argument("trace", help="a trace TIERFLOW_TRACE or tierflow.trace(path) wrote")
    p.add_argument("-o", "--output", default="step.png",
                   help="the picture (.png, .svg, .pdf; default step.png), or with --merge a .json trace")
    p.add_argument("--step", type=int, default=-1, help="which step: 0 the first, -1 (default) the last")
    p.add_argument("--merge", metavar="TORCH.json",
                   help="torch.profiler's exported trace (prof.export_chrome_trace): write both as one trace")
    p.add_argument("--title", help="the picture's title")
    a = p.parse_args(list(argv))
    try:
        if a.merge:
            if not a.output.endswith(".json"):
                raise TimelineError(f"--merge writes a trace: give -o a .json path (got {a.output!r})")
            merged = merge_files(a.trace, a.merge, a.output)
            print(f"wrote {a.output}: {len(merged['traceEvents'])} events (open it in https://ui.perfetto.dev)")
            return 0
        s = draw(load(a.trace), a.output, a.step, a.title)
    except TimelineError as e:
        print(f"python -m tierflow timeline: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.output}: step {s['index'] + 1} of {s['count']}, {(s['end'] - s['start']) / 1000.0:.1f} ms, "
          f"{len(s['spans'])} spans")
    return 0
