"""The installed C++ package (Note [Installed package] in cmake/tierflowConfig.cmake.in).

A trainer finds it with find_package(tierflow CONFIG REQUIRED) wherever the
prefix was copied to, and the torch-free part needs no Torch at all. Only
CMake's configure step runs here (seconds); `make cpp-example` builds and runs
the trainer against the installed package.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from children import run_child

# Every test here installs build/dev (cmake --install writes its manifest there): one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_cpp_package")  # the name conftest.py gives the module

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "dev"


def _cmake() -> str:
    venv_cmake = ROOT / ".venv" / "bin" / "cmake"
    found = str(venv_cmake) if venv_cmake.exists() else shutil.which("cmake")
    if not found:
        pytest.skip("cmake is not installed")
    return found


def _deps_prefix() -> list[str]:
    """The prefix the main build found its Debian packages in (.deps/usr from a bundle), if any."""
    cache = (BUILD / "CMakeCache.txt").read_text()
    m = re.search(r"^CMAKE_PREFIX_PATH:[A-Z]*=(.*)$", cache, re.M)
    return [m.group(1)] if m and m.group(1) else []


def _configure(source: Path, build: Path, prefixes: list[str]) -> subprocess.CompletedProcess:
    return run_child([_cmake(), "-S", str(source), "-B", str(build),
                           "-DCMAKE_PREFIX_PATH=" + ";".join(prefixes + _deps_prefix()),
                           "-DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON"],
                     capture_output=True, text=True)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    if not (BUILD / "CMakeCache.txt").exists():
        pytest.skip("build/dev is not configured (make setup)")
    prefix = tmp_path_factory.mktemp("install") / "prefix"
    done = run_child([_cmake(), "--install", str(BUILD), "--prefix", str(prefix)],
                     capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return prefix


def test_package_has_config_version_and_both_targets(installed):
    cmake_dir = installed / "lib" / "cmake" / "tierflow"
    names = {p.name for p in cmake_dir.iterdir()}
    assert {"tierflowConfig.cmake", "tierflowConfigVersion.cmake", "tierflowTargets.cmake",
            "tierflowTorchTargets.cmake", "Findtierflow_libaio.cmake", "Findtierflow_xxhash.cmake"} <= names
    targets = (cmake_dir / "tierflowTargets.cmake").read_text()
    assert "add_library(tierflow::tierflow INTERFACE IMPORTED)" in targets
    assert "add_library(tierflow::torch STATIC IMPORTED)" in (cmake_dir / "tierflowTorchTargets.cmake").read_text()
    assert (installed / "include" / "tierflow" / "bindings" / "block_offload.hpp").exists()


def test_package_names_no_path_of_this_machine(installed):
    for f in (installed / "lib" / "cmake" / "tierflow").glob("*.cmake"):
        text = f.read_text()
        for path in (str(installed), str(ROOT), torch.utils.cmake_prefix_path):
            assert path not in text, f"{f.name} names {path}: the package would not survive a move"


def test_moved_prefix_configures_the_example(installed, tmp_path):
    moved = tmp_path / "elsewhere" / "tierflow"
    shutil.copytree(installed, moved, symlinks=True)
    shutil.rmtree(installed)  # nothing may still point at the old place
    done = _configure(ROOT / "examples" / "cpp_trainer", tmp_path / "build",
                      [str(moved), torch.utils.cmake_prefix_path])
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"from {moved}/lib/cmake/tierflow" in done.stdout


def test_core_component_builds_without_torch(tmp_path):
    # A fresh install: the module's prefix was moved away by the test above.
    prefix = tmp_path / "prefix"
    done = run_child([_cmake(), "--install", str(BUILD), "--prefix", str(prefix)],
                     capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.22)\nproject(uses_core LANGUAGES CXX)\n"
        "find_package(tierflow 0.1 CONFIG REQUIRED COMPONENTS core)\n"
        "if(TARGET tierflow::torch OR TARGET torch)\n  message(FATAL_ERROR \"core pulled in torch\")\nendif()\n"
        "file(WRITE ${CMAKE_BINARY_DIR}/main.cpp \"#include <tierflow/core/config.hpp>\\n"
        "int main() { return tierflow::Config::defaults().aio_queue_depth > 0 ? 0 : 1; }\\n\")\n"
        "add_executable(uses_core ${CMAKE_BINARY_DIR}/main.cpp)\n"
        "target_link_libraries(uses_core PRIVATE tierflow::tierflow)\n")
    done = _configure(project, tmp_path / "build", [str(prefix)])  # no Torch in the search path
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_child([_cmake(), "--build", str(tmp_path / "build")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert run_child([str(tmp_path / "build" / "uses_core")]).returncode == 0
