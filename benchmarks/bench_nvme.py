"""NVMe tier benchmark: tierflow's libaio engine against fio, same request size,
queue depth, O_DIRECT, file size and file system, back to back in one run.

    PYTHONPATH=bindings/python .venv/bin/python benchmarks/bench_nvme.py [--dir DIR] [--bytes 2GiB]

Both write and then read one preallocated file sequentially in requests of the
block size with the queue depth in flight. fio's file is preallocated like
tierflow's (fallocate), so neither pays for extending a file. tierflow and fio
alternate so both see the same disk; each figure is the median of --repeats
runs (the best is kept too). Writes benchmarks/results/nvme.json.

The planner's NVMe probe (Note [NVMe probe]: ``Runtime.measure_nvme``, what
``auto`` plans with) is measured the same way, alternating with fio at the
engine's default request size and queue depth, at the size ``auto`` probes
with (``planner_probe`` in the JSON; ``--only-probe`` measures just that and
updates the JSON in place).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
from tierflow._report import write_json_atomic  # noqa: E402
ENGINE = os.path.join(ROOT, "build", "dev", "benchmarks", "bench_nvme_engine")
SIZES = {"64KiB": 64 << 10, "256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20, "16MiB": 16 << 20}


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def tierflow_run(dirs: list[str], nbytes: int, bs: int, qd: int) -> dict:
    out = subprocess.run([ENGINE, "--dirs", ",".join(dirs), "--bytes", str(nbytes), "--bs", str(bs),
                          "--qd", str(qd), "--repeats", "1"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def fio_run(path: str, nbytes: int, bs: int, qd: int, rw: str) -> float:
    cmd = ["fio", "--name=t", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}",
           "--direct=1", "--ioengine=libaio", f"--size={nbytes}", "--fallocate=none", "--output-format=json",
           "--numjobs=1", "--thread"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout)["jobs"][0]
    key = "write" if rw == "write" else "read"
    return job[key]["bw_bytes"] / 1e9


def compare(dirs: list[str], nbytes: int, bs: int, qd: int, repeats: int) -> dict:
    fio_file = os.path.join(dirs[0], "fio-bench.bin")
    with open(fio_file, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    runs = {"write_gbps": [], "read_gbps": [], "fio_write_gbps": [], "fio_read_gbps": []}
    try:
        for _ in range(repeats):
            t = tierflow_run(dirs, nbytes, bs, qd)
            runs["write_gbps"].append(t["write_gbps"])
            runs["read_gbps"].append(t["read_gbps"])
            runs["fio_write_gbps"].append(fio_run(fio_file, nbytes, bs, qd, "write"))
            runs["fio_read_gbps"].append(fio_run(fio_file, nbytes, bs, qd, "read"))
    finally:
        os.unlink(fio_file)
    result = summarise(runs)
    result.update({f"best_{k}": max(v) for k, v in runs.items()})
    result.update({"block_bytes": bs, "queue_depth": qd, "bytes": nbytes, "paths": len(dirs)})
    return result


def summarise(runs: dict) -> dict:
    """Medians of alternating runs and the ratios to fio: this disk's speed swings by 2x between back-to-back
    runs, and the median of alternating runs is what both tools sustain."""
    result = {k: statistics.median(v) for k, v in runs.items()}
    result["runs"] = runs
    result["read_over_fio"] = result["read_gbps"] / result["fio_read_gbps"]
    result["write_over_fio"] = result["write_gbps"] / result["fio_write_gbps"]
    return result


def probe_run(dirs: list[str], repeats: int) -> dict:
    """The planner's probe (what `auto` measures the NVMe tier with) beside fio, alternating, medians."""
    from tierflow import _C
    settings = {"device": "emulated", "offload_activations": "nvme", "nvme_paths": ",".join(dirs),
                "offload_optimizer": "none"}
    rt = _C.Runtime(settings)
    nbytes = int(_C.nvme_probe_bytes(int(rt.nvme_available_bytes())))
    cfg = rt.config()
    bs, qd = parse_size(cfg["TIERFLOW_AIO_BLOCK_SIZE"]), int(cfg["TIERFLOW_AIO_QUEUE_DEPTH"])
    fio_file = os.path.join(dirs[0], "fio-probe.bin")
    with open(fio_file, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    runs = {"write_gbps": [], "read_gbps": [], "fio_write_gbps": [], "fio_read_gbps": []}
    try:
        for _ in range(repeats):
            w, r = rt.measure_nvme(nbytes)
            runs["write_gbps"].append(w / 1e9)
            runs["read_gbps"].append(r / 1e9)
            runs["fio_write_gbps"].append(fio_run(fio_file, nbytes, bs, qd, "write"))
            runs["fio_read_gbps"].append(fio_run(fio_file, nbytes, bs, qd, "read"))
    finally:
        os.unlink(fio_file)
        del rt
    result = summarise(runs)
    result.update({"bytes": nbytes, "block_bytes": bs, "queue_depth": qd, "paths": len(dirs)})
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description="tierflow NVMe engine vs fio")
    ap.add_argument("--dir", default=os.path.join(ROOT, "build", "nvme-bench"),
                    help="directory on the file system to measure (not tmpfs)")
    ap.add_argument("--bytes", default="1GiB")
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "nvme.json"))
    ap.add_argument("--only-probe", action="store_true",
                    help="measure only the planner's probe beside fio and update planner_probe in --out")
    args = ap.parse_args()
    if not shutil.which("fio"):
        print("fio is not installed (Debian package fio; `make bench` installs it)", file=sys.stderr)
        return 1
    nbytes = parse_size(args.bytes)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=args.dir)
    a, b = os.path.join(work, "a"), os.path.join(work, "b")
    os.makedirs(a)
    os.makedirs(b)
    try:
        probe = probe_run([a], args.repeats)
        print(f"planner probe ({probe['bytes'] >> 20} MiB): write {probe['write_gbps']:.2f} GB/s (fio "
              f"{probe['fio_write_gbps']:.2f}, {probe['write_over_fio']:.2f}), read {probe['read_gbps']:.2f} GB/s "
              f"(fio {probe['fio_read_gbps']:.2f}, {probe['read_over_fio']:.2f})", flush=True)
        if args.only_probe:
            with open(args.out) as f:
                result = json.load(f)
            result["planner_probe"] = probe
            write_json_atomic(args.out, result)
            print("updated planner_probe in", args.out)
            return 0
        head = compare([a], nbytes, 1 << 20, args.qd, args.repeats)
        print(f"1MiB qd{args.qd}: write {head['write_gbps']:.2f} GB/s (fio {head['fio_write_gbps']:.2f}, "
              f"{head['write_over_fio']:.2f}), read {head['read_gbps']:.2f} GB/s (fio {head['fio_read_gbps']:.2f}, "
              f"{head['read_over_fio']:.2f})", flush=True)
        sweep = []
        for name, bs in SIZES.items():
            r = compare([a], nbytes, bs, args.qd, max(3, args.repeats - 4))
            sweep.append(r)
            print(f"  {name:>6}: write x{r['write_over_fio']:.2f} read x{r['read_over_fio']:.2f} "
                  f"({r['write_gbps']:.2f}/{r['read_gbps']:.2f} GB/s)", flush=True)
        qd_sweep = []
        for qd in (8, 32, 128):
            r = compare([a], nbytes, 1 << 20, qd, max(3, args.repeats - 4))
            qd_sweep.append(r)
            print(f"  qd{qd:>4} at 1MiB: write x{r['write_over_fio']:.2f} read x{r['read_over_fio']:.2f} "
                  f"({r['write_gbps']:.2f}/{r['read_gbps']:.2f} GB/s)", flush=True)
        striped = compare([a, b], nbytes, 1 << 20, args.qd, max(3, args.repeats - 4))
        print(f"striped over 2 paths (one file system): write {striped['write_gbps']:.2f} read "
              f"{striped['read_gbps']:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = dict(head)
    result.update({"planner_probe": probe, "sweep": sweep, "queue_depth_sweep": qd_sweep, "striped_two_paths": striped,
                   "file_system": subprocess.run(["df", "-T", args.dir], capture_output=True, text=True).stdout})
    write_json_atomic(args.out, result)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
