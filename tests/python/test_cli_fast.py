"""The command line without torch (issue 41 item 6): ``python -m tierflow plan`` with the figures given
(--tflops, --pcie-gbps) and a bad argument answer from the torch-free extension tierflow._core, never importing
torch (Note [Two extensions] in bindings/src/core_module.cpp); and the two extensions are one surface: _C's
names are _core's objects, an error raised in _C's C++ is tierflow.ConfigError, _core's settings pass to _C.

Whether torch was imported is the assertion, not the wall time (a loaded CI machine makes times noisy): the time
goes to loading torch (about 3 s here against 0.1 s without it)."""

import os
import sys

import pytest

from children import run_child
from harness import subprocess_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = ["plan", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "16", "--batch", "1", "--vocab", "1000",
         "--tflops", "1", "--pcie-gbps", "10"]

# As `python -m tierflow ARGS` runs it (the package, then cli.main), then what got imported: the last line.
CHILD = """
import sys
import tierflow
from tierflow.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
print("imported:", "torch" in sys.modules, "tierflow._C" in sys.modules)
sys.exit(code)
"""


def run(args, code=CHILD):
    env = subprocess_environment()
    env["PYTHONPATH"] = os.path.join(ROOT, "bindings", "python") + os.pathsep + env.get("PYTHONPATH", "")
    return run_child([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)


def test_plan_with_the_figures_given_loads_no_torch():
    done = run(SHAPE)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "imported: False False", done.stdout[-2000:]
    assert "compute: 1 TFLOP/s (given)" in done.stdout
    assert "links: 10 GB/s device->host, 10 GB/s host->device (given)" in done.stdout
    assert any(line.startswith("2 blocks:") for line in lines), done.stdout


def test_a_bad_argument_is_refused_without_torch():
    done = run(["plan", "--layers", "x", "--hidden", "64"])
    assert done.returncode == 2
    assert "--layers" in done.stderr and "accepted: an integer" in done.stderr, done.stderr
    assert done.stdout.splitlines()[-1] == "imported: False False", done.stdout
    done = run(["plna"])  # an unknown command
    assert done.returncode == 2 and "unknown command 'plna'" in done.stderr, done.stderr
    assert done.stdout.splitlines()[-1] == "imported: False False", done.stdout


def test_the_two_extensions_are_one_surface():
    # In this process torch and _C are loaded (conftest): _C's names are _core's objects, registered once.
    import tierflow
    from tierflow import _C, _core
    from tierflow._config import resolve_settings

    assert _C.ConfigError is tierflow.ConfigError is _core.ConfigError and _C.Settings is _core.Settings
    assert _C.plan_activations is _core.plan_activations and _C.StallError is _core.StallError
    with pytest.raises(tierflow.ConfigError, match="TIERFLOW_GPU_MEMORY"):  # thrown by _C's own copy of core
        _C.fsdp_settings_refusal({"TIERFLOW_GPU_MEMORY": "lots"}, False)
    refusal, _ = _C.ignored_settings(resolve_settings(), False)  # a _core.Settings into a _C function
    assert refusal is None
    # The package's lazy names (PEP 562) are the modules' own.
    assert tierflow.wrap is tierflow._wrap.wrap and tierflow.CPUAdamW is tierflow.optim.CPUAdamW
    assert all(getattr(tierflow, name) is not None for name in tierflow.__all__)
