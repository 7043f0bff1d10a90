"""Child processes started by the tests, with a hang guard instead of a time limit.

A test asserts behaviour, not speed (speed lives in benchmarks/). A child gets a timeout only so that a hung
child ends the test instead of the whole run; the guard is generous enough for a machine busy with other work
(two `make test` side by side on two cores), and when it fires the failure says so, with the child's output so
far. HANG_GUARD_SECONDS in the environment changes it (e.g. for a slower machine).
"""

from __future__ import annotations

import os
import subprocess

import pytest

HANG_GUARD_SECONDS = float(os.environ.get("HANG_GUARD_SECONDS", "1800"))


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="backslashreplace") if isinstance(data, bytes) else data


def hang_guard_failure(what: str, seconds: float, output: str = "") -> None:
    """Fails the test: `what` did not end within the guard."""
    pytest.fail(f"hang guard: {what} did not end within {seconds:.0f} s (a guard against a hang, not a speed "
                f"limit; HANG_GUARD_SECONDS sets it). Its output so far:\n{output[-4000:]}", pytrace=False)


def run_child(cmd, *, guard: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, **kwargs) under the hang guard (HANG_GUARD_SECONDS, or `guard` for a child that
    builds or installs for longer)."""
    seconds = max(guard or 0.0, HANG_GUARD_SECONDS)
    try:
        return subprocess.run(cmd, timeout=seconds, **kwargs)
    except subprocess.TimeoutExpired as e:
        hang_guard_failure(f"{cmd!r}"[:300], seconds, _text(e.stdout) + _text(e.stderr))
        raise  # not reached: pytest.fail raises


def wait_child(proc: subprocess.Popen, what: str, guard: float | None = None) -> int:
    """proc.wait() under the hang guard; a child that does not end is killed and the test fails."""
    seconds = max(guard or 0.0, HANG_GUARD_SECONDS)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        hang_guard_failure(what, seconds)
        raise


def in_own_process(test):
    """Runs `test` (a pytest test function) again in a fresh pytest process and passes or fails with it: for a
    test that needs what one process holds once, like the process-wide stall limit (Note [Stall timeout]),
    which any runtime an earlier test left alive in this worker would claim first."""
    import functools
    import inspect
    import sys

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("_IN_OWN_PROCESS") == test.__name__:
            return test(*args, **kwargs)
        path = inspect.getsourcefile(test)
        env = dict(os.environ, _IN_OWN_PROCESS=test.__name__)
        done = run_child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          f"{path}::{test.__name__}"], cwd=os.path.dirname(path), env=env,
                         capture_output=True, text=True)
        out = done.stdout[-4000:] + done.stderr[-2000:]
        assert done.returncode == 0 and " passed" in done.stdout, f"{test.__name__} in its own process:\n{out}"

    return run
