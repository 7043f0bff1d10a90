"""Fuzz of the configuration and of ``python -m tierflow plan`` (issue 16), with a fixed seed and bounded in time.

Every ``TIERFLOW_*`` variable of the table (read from ``tierflow.config_table()``) gets random values, through
the environment (bytes, as a process inherits them) and as keyword arguments (text): each either parses, and
its canonical text parses back to itself, or raises ``tierflow.ConfigError`` with one line naming the variable
and what is accepted; never another exception. Values that must never be accepted (bytes that are not UTF-8,
hex, inf and nan numbers, empty list items) are checked to be refused, and sizes to be exact.

Random argument sets for ``python -m tierflow plan`` run in-process through ``tierflow.__main__.main`` (a few
through a real subprocess): each exits 0 with a sane plan or 2 with one line naming an argument or variable;
an argument known to be bad is never a success.

The hand-written cases of the issue are tests of their own, here (the configuration) and in test_plan_cli.py
(the command).
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from decimal import ROUND_HALF_UP, Decimal

import pytest

import tierflow
from tierflow import _C
from tierflow.__main__ import main as tierflow_main
from tierflow.activations.profile import profile_to_json

from harness import subprocess_environment
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 16
U64_MAX = (1 << 64) - 1
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9, "tb": 10**12}
TABLE = tierflow.config_table()
NAMES = [row["name"] for row in TABLE]


# ---- helpers -------------------------------------------------------------------------------------------------


class Env:
    """Sets TIERFLOW_* variables (bytes) for a block, restoring the environment after."""

    def __init__(self, values: dict[bytes, bytes]):
        self.values = values

    def __enter__(self):
        self.saved = {k: os.environb.get(k) for k in self.values}
        os.environb.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environb.pop(k, None)
            else:
                os.environb[k] = v


def is_path_like(row: dict) -> bool:
    """Variables whose value is any text (file paths, directories)."""
    return "path" in row["accepted"] or "director" in row["accepted"]


def check_refusal(error: BaseException, name: str) -> None:
    """A refused value: ConfigError, one line, the variable and what is accepted named."""
    assert isinstance(error, tierflow.ConfigError), f"{name}: {type(error).__name__}: {error!r}"
    message = str(error)
    assert len(message.splitlines()) == 1 and "\n" not in message and "\r" not in message, repr(message)
    assert name in message, message
    assert "accepted" in message or "did you mean" in message, message


def exact_size(text: str) -> int | None:
    """The bytes a plain size "12.5 MiB" must parse to (None: not a plain size or not an integer byte count)."""
    m = re.fullmatch(r"\s*([0-9]*)(?:\.([0-9]*))?\s*([A-Za-z]*)\s*", text)
    if not m or not (m.group(1) or m.group(2)) or m.group(3).lower() not in UNITS:
        return None
    mult = UNITS[m.group(3).lower()]
    fraction = (m.group(2) or "").rstrip("0")
    if fraction and (mult == 1 or len(fraction) > 19):
        return None
    value = (Decimal(m.group(1) or "0") + (Decimal("0." + fraction) if fraction else 0)) * mult
    return int(value.to_integral_value(rounding=ROUND_HALF_UP))


# ---- random values -------------------------------------------------------------------------------------------

WORDS = sorted({w for row in TABLE for w in re.findall(r"[a-z][a-z0-9]+", row["accepted"] + " " + row["default"])})
NUMBERS = ["0", "1", "-1", "+1", "0.5", ".5", "5.", "1e3", "1E-2", "2.5e", "0x100", "0x0.8p0", "0X1P-2", "inf",
           "-inf", "nan", "NaN", "infinity", "1e999", "1e-999", "1_000", "1,5", "١٢", "９", "-0",
           "9223372036854775807", "9223372036854775808", "18446744073709551615", "18446744073709551616",
           "99999999999999999999999999", "1.000000000000000000000001", "0.0000001"]
SIZE_UNITS = ["", "B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "kib", "EB", "PiB", "%", "%%", "iB", " MiB"]
ODD = ["", " ", "\t", ",", ",,", "a,", ",a", "a,,b", "a, ,b", "/", ".", "/tmp", "/tmp/", "/tmp/x.json", "x\ny",
       "\u2028", "\x85", "\x0b", "é", "€", "😀", "'", "\\", '"', "%", "-", "auto,", "on off"]


def random_text(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        return rng.choice(WORDS)
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice(NUMBERS + [str(rng.randrange(10 ** rng.randrange(1, 22)))]) + rng.choice(SIZE_UNITS)
    if kind == 3:
        return rng.choice(ODD)
    if kind == 4:  # a list
        return ",".join(random_text(rng) if rng.random() < 0.3 else f"/mnt/d{rng.randrange(9)}"
                        for _ in range(rng.randrange(1, 4)))
    if kind == 5:  # random characters, some of them odd
        alphabet = "0123456789.eExX+-%, abcdefKMGTiB/\t\n\r\x0b\x1c\x85\u2028é€"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
    if kind == 6:  # case and spaces around an accepted word or number
        base = rng.choice(WORDS + NUMBERS[:8])
        base = base.upper() if rng.random() < 0.5 else base
        return rng.choice([" ", "", "\t"]) + base + rng.choice([" ", "", "\n"])
    return str(rng.uniform(-2, 2)) if rng.random() < 0.5 else f"{rng.randrange(0, 200)}%"


def random_bytes(rng: random.Random) -> bytes:
    """A value as the environment holds it: mostly UTF-8 text, sometimes bytes that are not UTF-8 (no NUL)."""
    text = random_text(rng).replace("\0", "")
    if rng.random() < 0.15:
        raw = bytearray(text.encode())
        for _ in range(rng.randrange(1, 3)):
            raw.insert(rng.randrange(len(raw) + 1), rng.choice([0x80, 0xC0, 0xFF, 0xED, 0xF4, 0xFE]))
        return bytes(raw)
    return text.encode()


def must_refuse(row: dict, raw: bytes) -> str | None:
    """Why this value can never be accepted (None: it may be)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    space = " \t\n\r\x0b\x0c"  # what the C++ side trims (isspace in the "C" locale)
    s = text.strip(space).lower()
    if not is_path_like(row) and (s.startswith(("0x", "-0x", "+0x")) or s.lstrip("+-") in ("inf", "nan", "infinity")):
        return "hex, inf or nan"
    if "director" in row["accepted"] and s and any(not item.strip(space) for item in text.split(",")):
        return "an empty list item"
    return None


# ---- the configuration fuzz ----------------------------------------------------------------------------------

def test_fuzz_every_variable():
    rng = random.Random(SEED)
    per_variable = 1000
    t0 = time.perf_counter()
    counts = {"accepted": 0, "refused": 0}
    for row in TABLE:
        name = row["name"]
        keyword = name.removeprefix("TIERFLOW_").lower()
        for i in range(per_variable):
            via_env = i % 2 == 0
            raw = random_bytes(rng) if via_env else None
            text = random_text(rng) if not via_env else None
            if not via_env and rng.random() < 0.05:
                text += "\udcff"  # a lone surrogate: undecodable bytes as Python holds them
            try:
                if via_env:
                    with Env({name.encode(): raw}):
                        resolved = tierflow.resolve_config()
                else:
                    resolved = tierflow.resolve_config(**{keyword: text})
            except Exception as e:  # noqa: BLE001 — anything but ConfigError fails below
                check_refusal(e, name)
                counts["refused"] += 1
                continue
            counts["accepted"] += 1
            shown = raw if via_env else text
            if via_env:
                why = must_refuse(row, raw)
                assert why is None, f"{name}={shown!r} accepted ({why}) as {resolved[name]!r}"
            else:
                assert "\udcff" not in text, f"{name}={shown!r} accepted"
                assert must_refuse(row, text.encode()) is None, f"{name}={shown!r} accepted as {resolved[name]!r}"
            canonical = resolved[name]
            again = tierflow.resolve_config(**{keyword: canonical})[name]
            assert again == canonical, f"{name}={shown!r}: {canonical!r} parses back as {again!r}"
            # Exact sizes: a plain size is the exact byte count, or refused when it does not fit.
            if name in ("TIERFLOW_MIN_OFFLOAD_BYTES", "TIERFLOW_PREFETCH_BYTES"):
                expected = exact_size(shown.decode() if via_env else shown)
                assert expected is not None and int(canonical) == expected <= U64_MAX, (name, shown, canonical)
    elapsed = time.perf_counter() - t0
    print(f"\nconfiguration fuzz: {len(TABLE)} variables x {per_variable} values: {counts['accepted']} accepted, "
          f"{counts['refused']} refused in {elapsed:.2f} s")
    assert counts["accepted"] > 2000 and counts["refused"] > 2000  # both sides exercised
    # No time limit: a test asserts behaviour, not speed, and a busy machine is not a fault (tests/README.md).


def test_sizes_that_fit_are_exact_and_the_rest_refused():
    rng = random.Random(SEED + 1)
    for _ in range(2000):
        unit = rng.choice(list(UNITS))
        digits = str(rng.randrange(10 ** rng.randrange(1, 22)))
        fraction = "" if rng.random() < 0.5 else "." + str(rng.randrange(10 ** rng.randrange(1, 8)))
        text = digits + fraction + unit.upper()
        expected = exact_size(text)
        try:
            got = int(tierflow.resolve_config(min_offload_bytes=text)["TIERFLOW_MIN_OFFLOAD_BYTES"])
        except tierflow.ConfigError as e:
            check_refusal(e, "TIERFLOW_MIN_OFFLOAD_BYTES")
            assert expected is None or expected > U64_MAX, f"{text} refused, {expected} fits"
            continue
        assert got == expected, f"{text}: {got} != {expected}"


# ---- the issue's hand-written cases for TIERFLOW_* ------------------------------------------------------------

@pytest.mark.parametrize("name, value, needles", [
    ("TIERFLOW_MAX_GRAD_NORM", "0x100", ["'0x100'", "none or a positive number"]),  # was 256
    ("TIERFLOW_GPU_OPTIMIZER_FRACTION", "0x0.8p0", ["'0x0.8p0'", "from 0 to 1"]),  # was 0.5
    ("TIERFLOW_MAX_GRAD_NORM", "inf", ["'inf'"]),
    ("TIERFLOW_GPU_OPTIMIZER_FRACTION", "nan", ["'nan'"]),
    ("TIERFLOW_NVME_PATHS", "/mnt/a,", ["'/mnt/a,'", "item 2 is empty"]),  # was /mnt/a, the empty item dropped
    ("TIERFLOW_NVME_PATHS", ",/mnt/a", ["item 1 is empty"]),
    ("TIERFLOW_NVME_PATHS", "/mnt/a,,/mnt/b", ["item 2 is empty"]),
    ("TIERFLOW_GPU_MEMORY", "0", ["TIERFLOW_GPU_MEMORY='0'", "0 bytes"]),  # failed later, not naming the variable
    ("TIERFLOW_HOST_MEMORY", "0GiB", ["TIERFLOW_HOST_MEMORY='0GiB'", "0 bytes"]),
    ("TIERFLOW_HOST_MEMORY", "20000000TB", ["'20000000TB'"]),  # past 2^64
    ("TIERFLOW_AIO_QUEUE_DEPTH", "0x10", ["'0x10'"]),
    ("TIERFLOW_EMULATED_SEED", "-1", ["'-1'", "from 0 to 2^63"]),
    ("TIERFLOW_LOG_LEVEL", "info\nTIERFLOW_X=1", ["'info\\nTIERFLOW_X=1'"]),
])
def test_issue16_bad_value_is_a_one_line_config_error(name, value, needles, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(tierflow.ConfigError) as info:
        tierflow.resolve_config()
    check_refusal(info.value, name)
    for n in needles:
        assert n in str(info.value), str(info.value)


def test_issue16_host_memory_past_2_to_63_is_exact(monkeypatch):
    # llround made 10000000TB 9223372036854775808 bytes.
    monkeypatch.setenv("TIERFLOW_HOST_MEMORY", "10000000TB")
    assert tierflow.resolve_config()["TIERFLOW_HOST_MEMORY"] == "10000000000000000000"


@pytest.mark.parametrize("name", ["TIERFLOW_REPORT", "TIERFLOW_PROFILE", "TIERFLOW_HOST_MEMORY", "TIERFLOW_NVME_PATHS"])
def test_issue16_value_not_utf8_is_a_config_error_not_unicode_decode_error(name):
    # Was UnicodeDecodeError from resolve_config.
    with Env({name.encode(): b"/tmp/r\xe9sum\xe9.json"}):
        with pytest.raises(tierflow.ConfigError) as info:
            tierflow.resolve_config()
    check_refusal(info.value, name)
    assert "\\xe9" in str(info.value) and "not UTF-8" in str(info.value)


def test_issue16_keyword_not_utf8_is_a_config_error():
    with pytest.raises(tierflow.ConfigError) as info:
        tierflow.resolve_config(report="/tmp/r\udce9sum.json")
    check_refusal(info.value, "TIERFLOW_REPORT")


def test_issue16_report_directory_is_refused_when_read(tmp_path, monkeypatch):
    # Was an error only at tierflow.report(), not naming the variable.
    monkeypatch.setenv("TIERFLOW_REPORT", str(tmp_path))
    with pytest.raises(tierflow.ConfigError) as info:
        tierflow.resolve_config()
    check_refusal(info.value, "TIERFLOW_REPORT")
    assert "directory" in str(info.value)
    monkeypatch.setenv("TIERFLOW_REPORT", str(tmp_path / "report.json"))
    assert tierflow.resolve_config()["TIERFLOW_REPORT"] == str(tmp_path / "report.json")


def test_issue16_unknown_variable_is_one_line(monkeypatch):
    monkeypatch.setenv("TIERFLOW_HOST_MEMROY", "1GiB")
    with pytest.raises(tierflow.ConfigError) as info:
        tierflow.resolve_config()
    check_refusal(info.value, "TIERFLOW_HOST_MEMORY")


# ---- the command-line fuzz -----------------------------------------------------------------------------------

LIMITS = _C.transformer_shape_limits()


def _shape_values(field: str, rng: random.Random) -> tuple[str, bool | None]:
    """A value for a shape argument and whether it is valid (None: depends on the others)."""
    if rng.random() < 0.93:
        small = {"layers": [1, 2, 3, 4, 8], "hidden": [16, 32, 64, 128], "heads": [1, 2, 4, 8, 3],
                 "seq": [1, 8, 64, 128], "batch": [1, 2, 4], "vocab": [10, 1000, 50304], "ffn_mult": [1, 2, 4]}[field]
        return str(rng.choice(small)), True
    good = [str(LIMITS[field]), "1"]
    bad = ["0", "-1", str(LIMITS[field] + 1), "1e9", "2147483648", "9223372036854775808", "18446744073709551616",
           "0x10", "", " ", "4.0", "nan", "٣", "+4", "1_0", "four", "9" * 5000]
    if rng.random() < 0.15:
        return rng.choice(good), None
    return rng.choice(bad), False


RATE_GOOD = ["100", "20", "1e-6", "1e6", "0.5", "55", " 3 "]
RATE_BAD = ["0", "-1", "nan", "inf", "-inf", "1e7", "1e-7", "0x10", "", "1_0", "abc", "1e999", "\udcff"]
BUDGET_GOOD = ["16GiB", "90%", "1GiB", "100%", "512MiB", "18446744073709551615", "1.5GiB", "64KiB"]
BUDGET_BAD = ["0", "0%", "101%", "1e3", "0x10", "sixteen", "", "18446744073709551616", "-1GiB", "16\udcffGiB",
              "16\nGiX", "nan%", "0x10%"]


def random_argv(rng: random.Random, profiles: dict[str, str]) -> tuple[list[str], bool, dict[bytes, bytes]]:
    """Random arguments, whether one of them is known to be bad, and TIERFLOW_* variables to set."""
    argv: list[str] = []
    bad = False
    use_profile = rng.random() < 0.15
    if use_profile:
        which = rng.choice(sorted(profiles))
        argv += ["--profile", profiles[which]]
        bad |= which != "good"
    if not use_profile or rng.random() < 0.05:
        for field in ("layers", "hidden", "heads", "seq", "batch", "vocab", "ffn_mult"):
            if field in ("vocab", "ffn_mult") and rng.random() < 0.6:
                continue
            if rng.random() < 0.03:
                continue  # missing: a usage error unless vocab or ffn_mult
            value, ok = _shape_values(field, rng)
            argv += [f"--{field.replace('_', '-')}", value]
            bad |= ok is False
    if rng.random() < 0.9:
        for flag in ("--tflops", "--pcie-gbps"):
            ok = rng.random() < 0.95
            argv += [flag, rng.choice(RATE_GOOD if ok else RATE_BAD)]
            bad |= not ok
    for flag in ("--gpu-memory", "--host-memory"):
        if rng.random() < 0.4:
            ok = rng.random() < 0.85
            argv += [flag, rng.choice(BUDGET_GOOD if ok else BUDGET_BAD)]
            bad |= not ok
    if rng.random() < 0.15:
        ok = rng.random() < 0.6
        argv += ["--nvme-memory", rng.choice(["1GiB", "100GiB"] if ok else ["5%", "x", "0x1", "-1"])]
        argv += ["--nvme-gbps", rng.choice(["2", "0.5"] if ok else RATE_BAD)]
        bad |= not ok
    if rng.random() < 0.2:
        ok = rng.random() < 0.6
        argv += ["--prefetch", rng.choice(["1", "64MiB", "1GiB"] if ok else ["0", "0x1", "-1", "1e3", "nan"])]
        bad |= not ok
    if rng.random() < 0.2:
        ok = rng.random() < 0.8
        argv += ["--dtype", rng.choice(["bf16", "fp16", "fp32"] if ok else ["fp8", "", "BF16"])]
        bad |= not ok
    if rng.random() < 0.2:
        ok = rng.random() < 0.8
        argv += ["--optimizer", rng.choice(["none", "host", "nvme"] if ok else ["gpu", "auto", ""])]
        bad |= not ok
    if rng.random() < 0.5:
        argv.append("--json")
    if rng.random() < 0.03:
        argv += rng.choice([["--layer-count", "3"], ["--layers"], ["stray"]])
        bad = True
    env: dict[bytes, bytes] = {}
    if rng.random() < 0.15:
        env[rng.choice(NAMES).encode()] = random_bytes(rng)
    return argv, bad, env


def check_plan_output(argv: list[str], out: str) -> None:
    """A success prints a sane plan."""
    get = lambda flag: argv[len(argv) - 1 - argv[::-1].index(flag) + 1] if flag in argv else None  # noqa: E731
    if "--json" not in argv:
        assert "predicted: device peak" in out and "plan (forward order):" in out, out
        return
    data = json.loads(out)
    layers, predicted, budgets = data["layers"], data["predicted"], data["budgets"]
    if get("--layers") is not None and "--profile" not in argv:
        assert len(layers) == int(get("--layers"))
        assert predicted["gpu_peak_bytes"] > 0 and data["state"]["gpu_bytes"] > 0
    assert 0 < predicted["gpu_peak_bytes"] <= budgets["gpu_bytes"]
    assert math.isfinite(predicted["step_seconds"]) and predicted["step_seconds"] >= 0
    assert predicted["step_seconds"] >= predicted["keep_all_step_seconds"] * (1 - 1e-9)
    assert budgets["prefetch_bytes"] >= 1
    for layer in layers:
        assert layer["keep"] + layer["swap"] + layer["recompute"] == pytest.approx(1.0)
        assert 0 <= layer["alpha"] <= 1


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = tierflow_main(["plan", *argv])
        except BaseException as e:  # noqa: BLE001
            raise AssertionError(f"plan {argv!r} raised {type(e).__name__}: {e}") from e
    return rc, out.getvalue(), err.getvalue()


def check_run(argv, bad, env, rc, out, err) -> None:
    where = f"plan {argv!r} with {env!r}"
    assert rc in (0, 2), f"{where}: exit {rc}\n{err}"
    assert "Traceback" not in err and "bad_alloc" not in err and "Invoked with" not in err, f"{where}: {err}"
    env_bad = False
    if env:
        try:
            with Env(env):
                tierflow.resolve_config()
        except tierflow.ConfigError:
            env_bad = True
    if rc == 0:
        assert not bad and not env_bad, f"{where}: a bad input accepted\n{out[-500:]}"
        check_plan_output(argv, out)
        return
    if out:  # --json: the error also as a JSON object on stdout, the same words as stderr's line
        assert any(a.startswith("--j") for a in argv), where
        assert json.loads(out) == {"error": err[len("tierflow plan: "):].rstrip("\n")}, f"{where}: {out!r}"
    assert err.startswith("tierflow plan: ") and err.endswith("\n") and len(err.splitlines()) == 1, f"{where}: {err!r}"
    named = re.search(r"--[a-z]|TIERFLOW_", err) or any(a and a in err for a in argv)
    assert named, f"{where}: names no argument or variable: {err!r}"
    if env_bad and not bad:
        assert any(k.decode() in err for k in env) or "TIERFLOW_" in err, f"{where}: {err!r}"


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    d = tmp_path_factory.mktemp("profiles")
    shape = _C.TransformerShape(layers=4, hidden=64, heads=4, seq=16, batch=2, dtype_bytes=2, vocab=100)
    good = json.loads(profile_to_json(_C.estimate_transformer(shape, 1e12), _C.Links(d2h=2e10, h2d=2e10, duplex=4e10),
                                      1 << 20))
    out = {}
    variants = {
        "good": {},
        "negative": {"blocks": {0: {"forward_seconds": -1.0}}},
        "nan": {"links": {"h2d": float("nan")}},
        "fixed": {"fixed_device_bytes": -5},
        "huge": {"fixed_device_bytes": 1e30},
        "inf": {"fixed_device_bytes": float("inf")},
        "text": {"blocks": {1: {"input_bytes": "1"}}},
        "sum": {"blocks": {0: {"cheap_bytes": 1 << 62}, 1: {"cheap_bytes": 1 << 62}}},
    }
    for name, change in variants.items():
        data = json.loads(json.dumps(good))
        for i, c in change.get("blocks", {}).items():
            data["blocks"][i].update(c)
        data["links"].update(change.get("links", {}))
        if "fixed_device_bytes" in change:
            data["fixed_device_bytes"] = change["fixed_device_bytes"]
        (d / f"{name}.json").write_text(json.dumps(data))
        out[name] = str(d / f"{name}.json")
    out["missing"] = str(d / "missing.json")
    out["directory"] = str(d)
    (d / "notjson.json").write_text("{")
    out["notjson"] = str(d / "notjson.json")
    return out


@pytest.mark.ordering
def test_fuzz_plan_command(profiles):
    rng = random.Random(SEED)
    runs, t0 = 1500, time.perf_counter()
    exits = {0: 0, 2: 0}
    for _ in range(runs):
        argv, bad, env = random_argv(rng, profiles)
        with Env(env):
            rc, out, err = run_in_process(argv)
        check_run(argv, bad, env, rc, out, err)
        exits[rc] += 1
    elapsed = time.perf_counter() - t0
    print(f"\nplan fuzz: {runs} argument sets in-process: {exits[0]} planned, {exits[2]} refused in {elapsed:.2f} s")
    assert exits[0] > 200 and exits[2] > 300


def test_fuzz_plan_command_subprocess(profiles):
    """A few random argument sets through a real process: the exit code and no traceback on stderr."""
    rng = random.Random(SEED + 2)
    e = subprocess_environment()
    e["PYTHONPATH"] = os.path.join(ROOT, "bindings", "python") + os.pathsep + e.get("PYTHONPATH", "")
    cases = []
    while len(cases) < 4:
        argv, bad, env = random_argv(rng, profiles)
        if "\udcff" in "".join(argv) or not env and len(cases) == 0:
            continue
        cases.append((argv, bad, env))
    cases.append((["--layers", "2147483648", "--hidden", "64", "--heads", "4", "--seq", "8", "--batch", "1"], True, {}))
    for argv, bad, env in cases:
        run_env = {k.encode(): v.encode() for k, v in e.items()}
        run_env.update(env)
        proc = run_child([sys.executable, "-m", "tierflow", "plan", *argv], env=run_env, capture_output=True)
        out, err = proc.stdout.decode(errors="backslashreplace"), proc.stderr.decode(errors="backslashreplace")
        check_run(argv, bad, env, proc.returncode, out, err)
