"""The long run of the training-loop fuzzer (tests/python/loop_fuzz.py, issue 37 part 4), in parallel processes.

    python scripts/fuzz_loops.py --seeds 10000 [--start 0] [--jobs 2] [--out build/fuzz-loops]
    make fuzz-loops SEEDS=10000 [JOBS=2] [START=0]

Each worker is a fresh interpreter (`loop_fuzz.py --seeds a:b --minimize --out part.jsonl`, one intra-op thread)
over its share of the seeds in batches; a worker that dies or hangs (a loop past --loop-timeout seconds) costs one
loop, recorded as a finding with its seed, and the batch goes on from the next seed. At the end a JSON summary
goes to stdout and to OUT/summary.json: the loops run, matches, refusals by what they named, findings of the known
causes (loop_fuzz.KNOWN_CAUSES) and new findings grouped by their cause and the minimal loop's features, each
with seeds and one minimal loop as a line to run again (`python tests/python/loop_fuzz.py --seed N`).
Exit status 1 when there is a new finding.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "tests", "python", "loop_fuzz.py")


def run_batch(first: int, last: int, part: str, loop_timeout: float, env: dict) -> None:
    """Seeds first..last-1 into `part` (JSON lines), restarting past a loop that kills or hangs its worker."""
    seed = first
    while seed < last:
        done_before = _finished(part)
        proc = subprocess.Popen([sys.executable, FUZZ, "--seeds", f"{seed}:{last}", "--minimize", "--out", part],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        last_progress, count = time.monotonic(), len(done_before)
        while proc.poll() is None:
            time.sleep(1.0)
            now_done = _finished(part)
            if len(now_done) != count:
                count, last_progress = len(now_done), time.monotonic()
            elif time.monotonic() - last_progress > loop_timeout:
                proc.kill()
                proc.wait()
        started = _started(part) - _finished(part).keys()
        pending = sorted(s for s in started if seed <= s < last)
        if proc.returncode in (0, 1) and not pending:
            return
        if not pending:  # died before starting a loop: give up on this batch rather than spin
            _append(part, {"seed": seed, "kind": "finding", "cause": f"worker:exit {proc.returncode}",
                           "detail": "the worker died before its first loop", "loop": "", "known": []})
            seed += 1
            continue
        bad = pending[0]
        _append(part, {"seed": bad, "kind": "finding", "cause": f"crash:worker exit {proc.returncode}",
                       "detail": "the loop killed its worker or ran past the per-loop timeout",
                       "loop": "", "known": []})
        seed = bad + 1


def _lines(part: str) -> list:
    if not os.path.exists(part):
        return []
    out = []
    with open(part) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a killed worker
    return out


def _finished(part: str) -> dict:
    return {r["seed"]: r for r in _lines(part) if "kind" in r}


def _started(part: str) -> set:
    return {r["started"] for r in _lines(part) if "started" in r}


def _append(part: str, rec: dict) -> None:
    with open(part, "a") as f:
        f.write(json.dumps(rec) + "\n")


def summarize(records: list) -> dict:
    kinds = collections.Counter(r["kind"] for r in records)
    refused = collections.Counter(r["cause"] for r in records if r["kind"] == "refused")
    known = collections.Counter(c for r in records if r["kind"] == "finding" for c in (r.get("known") or []))
    groups: dict = {}
    for r in records:
        if r["kind"] != "finding" or r.get("known"):
            continue
        minimal = r.get("minimal") or r.get("loop") or ""
        features = sorted(m.group(1) for m in re.finditer(r"(\w+)=", minimal)
                          if m.group(1) not in ("seed", "save_at", "max_norm", "steps", "dropout"))
        key = f"{r.get('minimal_cause') or r['cause']} [{', '.join(features)}]"
        g = groups.setdefault(key, {"count": 0, "seeds": [], "minimal": minimal,
                                    "detail": r.get("minimal_detail") or r["detail"]})
        g["count"] += 1
        if len(g["seeds"]) < 20:
            g["seeds"].append(r["seed"])
    return {"loops": len(records), "match": kinds["match"], "refused": kinds["refused"],
            "refused_naming": dict(refused.most_common()), "known_causes": dict(known.most_common()),
            "new_findings": sum(g["count"] for g in groups.values()),
            "new_by_cause": dict(sorted(groups.items(), key=lambda kv: -kv[1]["count"]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1000, help="how many seeds (default 1000)")
    ap.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: the cores)")
    ap.add_argument("--batch", type=int, default=250, help="seeds per worker process (default 250)")
    ap.add_argument("--loop-timeout", type=float, default=300.0, help="seconds a loop may take (hang guard)")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "fuzz-loops"), help="where the parts go")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MKL_CBWR="COMPATIBLE",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "bindings", "python"), os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in env.items() if not k.startswith("TIERFLOW_") or k in ("TIERFLOW_EMULATED_DEVICE",
                                                                               "TIERFLOW_EMULATED_SEED")}
    batches = [(a, min(a + args.batch, args.start + args.seeds))
               for a in range(args.start, args.start + args.seeds, args.batch)]
    todo = list(batches)
    lock = threading.Lock()
    began = time.monotonic()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                a, b = todo.pop(0)
            part = os.path.join(args.out, f"seeds-{a}-{b}.jsonl")
            if os.path.exists(part):
                os.remove(part)
            run_batch(a, b, part, args.loop_timeout, env)

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = []
    for a, b in batches:
        records += _finished(os.path.join(args.out, f"seeds-{a}-{b}.jsonl")).values()
    summary = summarize(records)
    summary.update(seeds=f"{args.start}:{args.start + args.seeds}", jobs=args.jobs,
                   device=env.get("TIERFLOW_EMULATED_DEVICE", "polite"),
                   wall_seconds=round(time.monotonic() - began, 1))
    text = json.dumps(summary, indent=2)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 1 if summary["new_findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
