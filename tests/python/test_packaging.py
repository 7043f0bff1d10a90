"""tierflow as a package: importable from any directory after the set-up, and as a
wheel that `pip install .` builds through scikit-build-core with tierflow._C."""

import os
import subprocess
import sys
import zipfile

import pytest
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")


@pytest.mark.skipif(not os.path.exists(VENV_PYTHON), reason="no .venv: run the set-up first (make setup)")
def test_the_set_up_makes_tierflow_importable_from_any_directory(tmp_path):
    # As a user would: another directory, no PYTHONPATH (the Makefile sets one; this must not need it).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    probe = "import tierflow, tierflow._C; print(tierflow.__file__); print(tierflow._C.__file__)"
    done = run_child([VENV_PYTHON, "-c", probe], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    init, extension = done.stdout.split()[-2:]
    sources = os.path.join(ROOT, "bindings", "python", "tierflow")
    assert init == os.path.join(sources, "__init__.py")
    assert os.path.dirname(extension) == sources and os.path.basename(extension).startswith("_C.")


@pytest.mark.skipif(os.environ.get("CI_BUILD_WHEEL") != "1",
                    reason="compiles the whole project again (~2 min); .ci/run sets CI_BUILD_WHEEL=1")
def test_wheel_contains_the_extension_and_the_package(tmp_path):
    # --no-build-isolation: build against this environment's torch, as a user with a CUDA torch would. Built
    # unoptimized (RelWithDebInfo's flags replaced by -DNDEBUG alone, which pybind11 adds no LTO to): what is checked
    # here is what the wheel holds, not its speed, and the release flags (-O3, LTO) cost CI about 1.7 times the CPU
    # (test_bundle.py builds its offline copy the same way). pyproject.toml's own build type is what a user gets.
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path),
           "--config-settings=cmake.build-type=RelWithDebInfo",
           "--config-settings=cmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO=-DNDEBUG",
           f"--config-settings=build-dir={tmp_path / 'build'}", ROOT]  # not build/{wheel_tag}: a user's build keeps its flags
    done = run_child(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(tmp_path / wheels[0]).namelist()
    assert any(n.startswith("tierflow/_C") and n.endswith(".so") for n in names), names
    assert any(n.startswith("tierflow/_core") and n.endswith(".so") for n in names), names  # Note [Two extensions]
    package = os.path.join(ROOT, "bindings", "python", "tierflow")
    # Every module, in the package's folders too (activations/, optim/, cli/).
    modules = sorted(os.path.relpath(os.path.join(d, f), package)
                     for d, _, files in os.walk(package) for f in files if f.endswith(".py"))
    assert "optim/adamw.py" in modules and "activations/runner.py" in modules, modules
    missing = [m for m in modules if f"tierflow/{m}" not in names]
    assert not missing, f"the wheel lacks {missing}"
    # The C++ package (headers, archives, CMake config) is for `cmake --install`, not the wheel.
    assert not [n for n in names if n.endswith((".a", ".hpp", ".cmake"))], names
