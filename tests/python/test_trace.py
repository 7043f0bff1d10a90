"""Note [Trace]: tierflow.trace(path) and TIERFLOW_TRACE write the Chrome trace format (every event's fields), with a
lane for each kind of work; the trace merges with torch.profiler's on one clock (tierflow's block ranges inside
torch's step ranges and beside torch's own record_function ranges of them); `python -m tierflow timeline` draws a
step. The recorder's own format, threads and off-switch: tests/cpp/test_trace.cpp."""

from __future__ import annotations

import gc
import importlib.util
import json
import os

import pytest
import torch

import tierflow
from tierflow import _C
from tierflow._trace import trace
from tierflow.cli import main as cli_main
from tierflow.cli.timeline import merge, one_step
from harness import gpt_task

TASK = dict(layers=2, width=32, block=32, batch=4, dropout=0.0)


def check_format(doc: dict) -> None:
    """The Chrome trace event format as torch.profiler exports it and Perfetto reads it."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    assert doc["displayTimeUnit"] in ("ms", "ns")
    assert isinstance(doc["baseTimeNanoseconds"], int)
    per_thread: dict = {}
    for e in doc["traceEvents"]:
        for k in ("name", "ph", "ts", "pid", "tid"):
            assert k in e, f"{k} missing from {e}"
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert e["ph"] in ("X", "C", "M"), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            assert isinstance(e["cat"], str) and isinstance(e["args"], dict), e
            per_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
        else:
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index"), e
            assert "name" in e["args"] or "sort_index" in e["args"], e
    for spans in per_thread.values():  # a thread's complete events never overlap (they could not nest)
        spans.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:])), spans


def lanes(doc: dict) -> set:
    return {e["args"]["name"].split(" #")[0].removeprefix("tierflow: ") for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def train_steps(model, opt, task, steps: int, device: str, profiler=None, first: int = 0) -> None:
    for i in range(first, first + steps):
        with torch.profiler.record_function(f"train step {i}") if profiler is not None else _nothing():
            loss = task.loss(model, task.batch_on(i, device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_trace_lanes_format_and_torch_profiler_merge(device, tmp_path):
    task = gpt_task(**TASK)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations="recompute")
    path, torch_path = str(tmp_path / "tierflow.json"), str(tmp_path / "torch.json")
    train_steps(model, opt, task, 1, device)  # outside: not in the trace (and the blocks' ops recorded)
    with trace(path), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_steps(model, opt, task, 2, device, profiler=prof, first=1)
    prof.export_chrome_trace(torch_path)
    assert not _C.trace_on(), "leaving trace() stops recording"
    with open(path) as f:
        doc = json.load(f)
    check_format(doc)
    assert {"block forward", "block backward", "block replay", "copy device -> host", "copy host -> device",
            "CPU AdamW"} <= lanes(doc), lanes(doc)
    threads = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert not [n for n in threads if n.startswith("tierflow: block") and "#" in n], "blocks run one at a time"
    forwards = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "block" and "forward" in e["name"]]
    assert sorted(e["args"]["block"] for e in forwards) == [0, 0, 1, 1], "each block's forward, each traced step"
    copies = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "copy"]
    assert all(e["args"]["bytes"] > 0 for e in copies)
    tiers = [e for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == "bytes per tier"]
    assert tiers and max(e["args"]["pinned host"] for e in tiers) > 0, "the inputs swapped to the host show"

    # torch's own trace has tierflow's block ranges (record_function), at the times tierflow's trace has them.
    with open(torch_path) as f:
        torch_doc = json.load(f)
    merged = merge(doc, torch_doc)
    out = str(tmp_path / "merged.json")  # the command line writes the same file
    assert cli_main(["timeline", path, "--merge", torch_path, "-o", out]) == 0
    with open(out) as f:
        assert json.load(f)["traceEvents"] == merged["traceEvents"]
    ev = merged["traceEvents"]
    tierflow_threads = {(e["pid"], e["tid"]) for e in ev if e.get("ph") == "M" and e["name"] == "thread_name"
                        and e["args"]["name"].startswith("tierflow: ")}
    check_format({**merged, "traceEvents": [e for e in ev if (e.get("pid"), e.get("tid")) in tierflow_threads
                                            or e.get("name") == "bytes per tier"]})
    assert all(isinstance(e["ts"], (int, float)) and e["ts"] >= 0 for e in ev if "ts" in e), "one clock, no gaps"
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and
                   str(e.get("name", "")).startswith("train step"))
    assert len(steps) == 2
    ours = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "block"]
    assert len(ours) >= 12
    for e in ours:  # every tierflow block span inside one of torch's step ranges (1 ms of clock reading slack)
        assert any(a - 1000 <= e["ts"] and e["ts"] + e["dur"] <= b + 1000 for a, b in steps), (e, steps)
    theirs = {(e["name"], round(e["ts"])) for e in ev if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and "block" in e["name"]}
    for e in (x for x in ours if "forward" in x["name"]):  # the same range, seen by both, within 1 ms
        near = [t for n, t in theirs if n == e["name"] and abs(t - e["ts"]) < 1000]
        assert near, (e, sorted(theirs))


def test_tierflow_trace_setting_nvme_lanes_and_timeline(device, nvme_dir, tmp_path):
    task = gpt_task(**TASK)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = str(tmp_path / "run.json")
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations="recompute", offload_optimizer="nvme",
                               nvme_paths=nvme_dir, trace=path)
    assert _C.trace_on(), "TIERFLOW_TRACE records from the wrap on"
    train_steps(model, opt, task, 2, device)
    assert not os.path.exists(path)
    tierflow.unwrap(model)
    del model, opt
    gc.collect()
    assert os.path.exists(path), "written when the runtime ends"
    with open(path) as f:
        doc = json.load(f)
    check_format(doc)
    assert {"block forward", "NVMe write", "NVMe read"} <= lanes(doc), lanes(doc)
    assert not _C.trace_on()
    s = one_step(doc)
    assert s["count"] == 2 and s["spans"] and s["end"] > s["start"]
    png = str(tmp_path / "step.png")
    if importlib.util.find_spec("matplotlib") is None:  # scripts/setup.sh installs it; without it, a clear refusal
        assert cli_main(["timeline", path, "-o", png]) == 2 and not os.path.exists(png)
        return
    assert cli_main(["timeline", path, "-o", png]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["timeline", path, "--step", "7", "-o", png]) == 2  # two steps: a clear refusal


def test_trace_path_refused_when_its_folder_is_missing(tmp_path):
    with pytest.raises(tierflow.ConfigError, match="does not exist"):
        trace(str(tmp_path / "no" / "t.json"))


def _counters_in(doc: dict, start: float, end: float) -> list:
    return [e for e in doc["traceEvents"]
            if e["ph"] == "C" and e["name"] == "bytes per tier" and start <= e["ts"] <= end]


def test_timeline_steps_are_optimizer_steps_under_accumulation_and_without_block_spans(device, tmp_path):
    # auto whose plan keeps everything after its first step: no block spans from then on, yet each optimizer step
    # (of two micro-batches) is a step of the timeline, and the bytes per tier are still sampled.
    task = gpt_task(**TASK)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = str(tmp_path / "acc.json")
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations="auto", trace=path)
    for step in range(3):
        for micro in range(2):
            (task.loss(model, task.batch_on(2 * step + micro, device)) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del model, opt
    gc.collect()
    with open(path) as f:
        doc = json.load(f)
    check_format(doc)
    assert "steps" in lanes(doc)
    marks = sorted((e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"), key=lambda e: e["ts"])
    assert [(e["name"], e["args"]["forwards"]) for e in marks] == [("step 1", 2), ("step 2", 2), ("step 3", 2)]
    s = one_step(doc)
    assert (s["count"], s["index"], s["split"]) == (3, 2, "steps"), (s["count"], s["index"], s["split"])
    assert (s["start"], s["end"]) == (marks[-1]["ts"], marks[-1]["ts"] + marks[-1]["dur"])
    assert one_step(doc, 0)["start"] == marks[0]["ts"]
    assert _counters_in(doc, s["start"], s["end"]), "bytes per tier sampled in a step whose plan keeps everything"
    if importlib.util.find_spec("matplotlib") is not None:
        assert cli_main(["timeline", path, "--step", "2", "-o", str(tmp_path / "s.png")]) == 0


def test_trace_path_errors_come_up_front_and_never_mask_the_body(tmp_path, monkeypatch):
    with pytest.raises(tierflow.ConfigError, match=r"TIERFLOW_TRACE=.*no_such_dir_zz.*keyword trace"):
        tierflow.wrap(torch.nn.Linear(2, 2), trace=str(tmp_path / "no_such_dir_zz" / "t.json"))
    with pytest.raises(tierflow.ConfigError, match=r"tierflow\.trace\(path='/proc/nope.json'\)"):
        trace("/proc/nope.json")
    # The folder goes while the body runs: the body's own exception comes out, the failed write only a warning.
    folder = tmp_path / "d"
    folder.mkdir()
    with pytest.warns(RuntimeWarning, match=r"tierflow\.trace\(path=.*the trace was not written"):
        with pytest.raises(ValueError, match="the body's"):
            with trace(str(folder / "t.json")):
                folder.rmdir()
                raise ValueError("the body's")
    assert not _C.trace_on()
    # A runtime whose settings say no trace (python -m tierflow plan's measuring one) writes none.
    monkeypatch.setenv("TIERFLOW_TRACE", str(tmp_path / "env.json"))
    r = _C.Runtime({"TIERFLOW_TRACE": ""})
    assert not _C.trace_on()
    del r
    gc.collect()
    assert not os.path.exists(tmp_path / "env.json")
