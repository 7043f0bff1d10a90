#!/usr/bin/env python3
"""README.md's sample of `make demo`'s output, taken from a real run (issue 41 item 6).

    python3 scripts/readme_sample.py --run     # runs the demo, records its whole output in
                                               # docs/demo-output.txt, writes the sample into README.md
    python3 scripts/readme_sample.py           # writes the sample from docs/demo-output.txt
    python3 scripts/readme_sample.py --check   # exit 1 when README.md's sample is not the recorded run's

The sample is the lines of the recorded output that begin with SAMPLE's prefixes, in that order, as the demo
printed them (leading spaces dropped). tests/python/test_readme.py checks README.md against the record, and
that the demo still prints each prefix.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "docs", "demo-output.txt")
README = os.path.join(ROOT, "README.md")
# The README paragraph the sample's fenced block follows.
ANCHOR = "One run on the 2-core development machine"
SAMPLE = ("largest relative loss difference:", "device bytes held by saved activations, peak:", "moved gpu->host",
          "step time (mean after warm-up):", "stepped during backward")


def sample_of(output: str) -> list:
    """The sample lines of a demo's output; raises naming a prefix the output lacks."""
    lines = [line.strip() for line in output.splitlines()]
    out = []
    for prefix in SAMPLE:
        found = next((line for line in lines if line.startswith(prefix)), None)
        if found is None:
            raise SystemExit(f"readme_sample: the demo's output has no line beginning {prefix!r}")
        out.append(found)
    return out


def readme_block(text: str) -> tuple:
    """(start, end) line indices of the fenced block after ANCHOR's paragraph: the lines between the fences."""
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if ANCHOR in line), None)
    if at is None:
        raise SystemExit(f"readme_sample: README.md has no paragraph with {ANCHOR!r}")
    start = next(i for i in range(at, len(lines)) if lines[i].startswith("```")) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    return start, end


def recorded_sample() -> list:
    with open(RECORD) as f:
        return sample_of(f.read())


def readme_sample(text: str) -> list:
    start, end = readme_block(text)
    return text.split("\n")[start:end]


def write_readme(sample: list) -> None:
    with open(README) as f:
        text = f.read()
    start, end = readme_block(text)
    lines = text.split("\n")
    lines[start:end] = sample
    with open(README, "w") as f:
        f.write("\n".join(lines))


def run_demo(demo_args: list) -> str:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "bindings", "python"))
    cmd = [sys.executable, os.path.join("examples", "train_gpt.py"), *demo_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"readme_sample: the demo failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    head = (f"# make demo's output, recorded by scripts/readme_sample.py --run on "
            f"{datetime.date.today().isoformat()}: {platform.machine()}, {os.cpu_count()} cores, "
            f"python examples/train_gpt.py {' '.join(demo_args)}".rstrip() + "\n")
    return head + proc.stdout


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the demo and record its output first")
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md's sample is not the record's")
    ap.add_argument("demo_args", nargs="*", help="arguments for examples/train_gpt.py (with --run)")
    args = ap.parse_args(argv)
    if args.run:
        output = run_demo(args.demo_args)
        sample_of(output)  # every prefix is there before anything is written
        with open(RECORD, "w") as f:
            f.write(output)
    if args.check:
        with open(README) as f:
            have = readme_sample(f.read())
        want = recorded_sample()
        if have != want:
            print("README.md's demo sample is not docs/demo-output.txt's: run scripts/readme_sample.py", file=sys.stderr)
            return 1
        return 0
    write_readme(recorded_sample())
    return 0


if __name__ == "__main__":
    sys.exit(main())
