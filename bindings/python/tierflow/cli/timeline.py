"""``python -m tierflow timeline TRACE -o step.png``: one step of a tierflow trace (TIERFLOW_TRACE, tierflow.trace)
drawn with matplotlib: the bytes per tier over time above one lane per kind of work (Note [Trace] in
core/include/tierflow/core/trace.hpp). ``--merge TORCH.json -o merged.json`` writes the trace and torch.profiler's
exported one as one file on one clock, for Perfetto. Torch-free: it reads JSON only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

LANE_PREFIX = "tierflow: "
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


def load(path: str) -> dict:
    """The Chrome trace at ``path`` (a JSON object with traceEvents, or a bare list of events)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise TimelineError(f"cannot read the trace {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise TimelineError(f"{path} is not JSON ({e}); give a trace TIERFLOW_TRACE or tierflow.trace wrote") from None
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TimelineError(f"{path} is not a Chrome trace (no traceEvents list)")
    return doc


# ---- merging with torch.profiler's trace ----------------------------------------------------------------------


def _base_ns(doc: dict) -> int:
    # Kineto (torch.profiler) and tierflow: ts are microseconds since baseTimeNanoseconds (CLOCK_REALTIME).
    return int(doc.get("baseTimeNanoseconds", 0))


def merge(tierflow_doc: dict, torch_doc: dict) -> dict:
    """One trace with both files' events on the earlier of their two bases (Note [Trace]'s clock)."""
    tb, kb = _base_ns(tierflow_doc), _base_ns(torch_doc)
    if tb == 0 or kb == 0:
        raise TimelineError("both traces need a baseTimeNanoseconds (torch.profiler's export_chrome_trace writes one "
                            "since torch 2.1, tierflow's always): without one their clocks cannot be lined up")
    base = min(tb, kb)
    # Shifts in microseconds, from integers: a realtime in microseconds (1.8e15) has no room for fractions.
    torch_shift, tierflow_shift = (kb - base) / 1000.0, (tb - base) / 1000.0
    torch_events = [dict(e) for e in torch_doc["traceEvents"]]
    torch_pids = {e.get("pid") for e in torch_events if e.get("ph") == "M" and e.get("name") == "process_name"}
    out_events = []
    for e in torch_events:
        if e.get("ph") != "M" and "ts" in e:
            e["ts"] = round(float(e["ts"]) + torch_shift, 3)
        out_events.append(e)
    for e in tierflow_doc["traceEvents"]:
        e = dict(e)
        if e.get("ph") == "M":
            if e.get("name") == "process_name" and e.get("pid") in torch_pids:
                continue  # the same process: torch names it; tierflow's lanes are its threads
        else:
            e["ts"] = round(float(e["ts"]) + tierflow_shift, 3)
        out_events.append(e)
    out = {k: v for k, v in torch_doc.items() if k != "traceEvents"}
    out["traceEvents"] = out_events
    out["baseTimeNanoseconds"] = base
    out.setdefault("displayTimeUnit", "ms")
    return out


def merge_files(tierflow_path: str, torch_path: str, out_path: str) -> dict:
    """merge() of two files, written to ``out_path``; returns the merged trace."""
    merged = merge(load(tierflow_path), load(torch_path))
    with open(out_path, "w") as f:
        json.dump(merged, f)
    return merged


# ---- one step ------------------------------------------------------------------------------------------------


def lanes_of(doc: dict) -> dict:
    """(pid, tid) -> lane name, for tierflow's lanes (thread_name "tierflow: ...", a lane's further threads
    "tierflow: ... #2": one lane)."""
    out = {}
    for e in doc["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            name = str(e.get("args", {}).get("name", ""))
            if name.startswith(LANE_PREFIX):
                out[(e.get("pid"), e.get("tid"))] = name[len(LANE_PREFIX):].split(" #")[0]
    return out


def steps_of(spans: list) -> list:
    """The steps' (start, end) times. A trace with step markers (the "steps" lane: each optimizer step from its
    first forward to its step()'s end, Note [Trace]) is split by them; an older trace without any by each forward
    of the first block (the lowest index), a step ending where the next begins (the last: at the trace's last
    event); [] without either."""
    marks = sorted((s["ts"], s["ts"] + s["dur"]) for s in spans if s["lane"] == "steps")
    if marks:
        return marks
    forwards = [s for s in spans if s["lane"] == "block forward"]
    if not forwards:
        return []
    first = min(s["args"].get("block", 0) for s in forwards)
    starts = sorted(s["ts"] for s in forwards if s["args"].get("block", 0) == first)
    last = max(s["ts"] + s["dur"] for s in spans)
    return [(a, b) for a, b in zip(starts, starts[1:] + [last])]


def one_step(doc: dict, step: int = -1) -> dict:
    """The events of step ``step`` (Python's index: -1 the last; the picture names it 1-based, as step_stats and the
    trace's markers do): {"start", "end", "spans", "counters", "count",
    "index", "split"}; ``split`` says what the steps were told apart by: "steps" (the trace's step markers),
    "block forward" (an older trace: the first block's forwards) or "trace" (neither: the whole trace, one step)."""
    lanes = lanes_of(doc)
    spans, counters = [], []
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in lanes:
            spans.append({"lane": lanes[(e["pid"], e["tid"])], "name": e.get("name", ""), "ts": float(e["ts"]),
                          "dur": float(e.get("dur", 0)), "args": e.get("args") or {}})
        elif e.get("ph") == "C" and e.get("name") == "bytes per tier":
            counters.append((float(e["ts"]), e.get("args") or {}))
    if not spans:
        raise TimelineError("the trace has no tierflow events: was TIERFLOW_TRACE (or tierflow.trace) on while a "
                            "wrapped model trained?")
    steps = steps_of(spans)
    split = "steps" if any(s["lane"] == "steps" for s in spans) else "block forward" if steps else "trace"
    if not steps:
        steps = [(min(s["ts"] for s in spans), max(s["ts"] + s["dur"] for s in spans))]
    try:
        start, end = steps[step]
    except IndexError:
        raise TimelineError(f"--step {step}: the trace has {len(steps)} step(s) (0 to {len(steps) - 1}, or -1 "
                            "for the last)") from None
    k = step % len(steps)
    inside = [s for s in spans if s["ts"] < end and s["ts"] + s["dur"] > start or s["ts"] == start]
    before = [c for c in counters if c[0] <= start]
    series = [c for c in counters if start <= c[0] <= end]
    if before:
        series.insert(0, (start, before[-1][1]))
    return {"start": start, "end": end, "spans": inside, "counters": series, "count": len(steps), "index": k,
            "split": split}


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
