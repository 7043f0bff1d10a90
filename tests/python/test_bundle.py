"""`make bundle` and the set-up from a bundle on a machine with no package registry.

The full round trip (download, then an offline set-up and build in a fresh copy
of the repository) needs the registries and a build (~2-3 min), so it runs in CI
(.ci/run sets CI_BUILD_WHEEL=1) and is skipped by a developer's `make test`.
"""

import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What scripts/setup.sh needs from a bundle (besides Debian packages, which it lists itself).
WHEEL_PACKAGES = ("pybind11", "scikit_build_core", "numpy", "pytest", "pytest_xdist", "transformers", "accelerate", "peft")
LIBRARIES = ("libmimalloc.so", "libtbb.so", "libaio.so", "libxxhash.so")


def _fake_apt(bin_dir, log):
    """apt-get, apt and sudo that record their call and fail: the offline set-up must not reach them."""
    os.makedirs(bin_dir, exist_ok=True)
    for name in ("apt-get", "apt", "sudo"):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\necho "{name} $*" >>"{log}"\necho "{name} must not run here" >&2\nexit 97\n')
        os.chmod(path, 0o755)


def _offline_env(bin_dir, **extra):
    """This environment with every registry unusable: pip has no index, and no proxy leads anywhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "TIERFLOW_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV", "CMAKE_ARGS")}
    dead = "http://127.0.0.1:9"
    env.update(PATH=bin_dir + os.pathsep + env["PATH"], PIP_NO_INDEX="1", PIP_INDEX_URL=dead + "/simple",
               http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead, **extra)
    return env


def _copy_working_tree(dst):
    """The files git would commit now (tracked and untracked, not ignored), as a fresh clone would have them."""
    listed = run_child(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                       capture_output=True, check=True).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.lexists(src):  # a tracked file deleted in the working tree is not copied
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel), follow_symlinks=False)


def _torch_only_site(dst):
    """A directory holding torch and what it needs, and nothing else, linked from this environment.

    A .venv that sees only this is a GPU machine's Python as far as tierflow's
    set-up can tell: torch is there, pybind11, numpy and pytest are not.
    """
    os.makedirs(dst)
    todo, seen = ["torch"], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if not os.path.lexists(os.path.join(dst, top)):
                os.symlink(dist.locate_file(top), os.path.join(dst, top))
    return seen


def _setup(repo, env):
    done = run_child(["make", "-C", repo, "--no-print-directory", "setup"], env=env, capture_output=True,
                     text=True)
    return done, done.stdout + done.stderr


def test_setup_refuses_an_incomplete_bundle_without_calling_apt(tmp_path):
    bundle = tmp_path / "bundle"
    os.makedirs(bundle / "debs")
    (bundle / "debs" / "libaio1_0.3.113-4_amd64.deb").write_bytes(b"not a package")
    bin_dir, log = str(tmp_path / "bin"), str(tmp_path / "apt.log")
    _fake_apt(bin_dir, log)
    env = _offline_env(bin_dir, TIERFLOW_BUNDLE=str(bundle))
    # A repository of the set-up script alone: it must stop before it needs anything else.
    script = tmp_path / "repo" / "scripts" / "setup.sh"
    os.makedirs(script.parent)
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), script)

    done = run_child(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "no MANIFEST.txt" in done.stderr and str(bundle) in done.stderr, done.stderr

    # A manifest that a file no longer matches (a copy cut short) is refused too, naming the file.
    (bundle / "MANIFEST.txt").write_text("# a bundle\n" + "0" * 64 + "  debs/libaio1_0.3.113-4_amd64.deb\n")
    done = run_child(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "libaio1_0.3.113-4_amd64.deb" in done.stderr and "differ from its MANIFEST.txt" in done.stderr, done.stderr
    assert not os.path.exists(log), open(log).read()


@pytest.mark.skipif(os.environ.get("CI_BUILD_WHEEL") != "1",
                    reason="downloads a bundle and builds the project again offline (~3 min); .ci/run sets CI_BUILD_WHEEL=1")
def test_make_bundle_then_offline_setup_builds_and_imports(tmp_path):
    # 1. The bundle, made with the registries.
    bundle = tmp_path / "bundle"
    made = run_child(["make", "-C", ROOT, "--no-print-directory", "bundle", f"BUNDLE={bundle}"],
                     capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    manifest = (bundle / "MANIFEST.txt").read_text()
    listed = re.findall(r"^[0-9a-f]{64}  (\S+)$", manifest, re.M)
    assert sorted(listed) == sorted(os.path.relpath(p, bundle) for p in glob.glob(str(bundle / "*" / "*"))), manifest
    debs = {os.path.basename(p).split("_")[0] for p in listed if p.endswith(".deb")}
    assert {"libaio-dev", "libtbb-dev", "libmimalloc-dev", "libxxhash-dev", "nlohmann-json3-dev", "libgtest-dev",
            "libgmock-dev"} <= debs
    wheels = {canonicalize_name(os.path.basename(p).split("-")[0]) for p in listed if p.endswith(".whl")}
    assert {canonicalize_name(p) for p in WHEEL_PACKAGES} <= wheels, wheels
    assert "torch" not in wheels and not any(w.startswith("nvidia") for w in wheels), wheels

    # 2. A fresh copy of the repository whose Python has torch and nothing else.
    repo = str(tmp_path / "repo")
    _copy_working_tree(repo)
    run_child([sys.executable, "-m", "venv", os.path.join(repo, ".venv")], check=True)
    vpy = os.path.join(repo, ".venv", "bin", "python")
    site = run_child([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert "torch" in _torch_only_site(str(tmp_path / "torch-site"))
    with open(os.path.join(site, "_node_torch.pth"), "w") as f:
        f.write(str(tmp_path / "torch-site") + "\n")
    missing = run_child([vpy, "-c", "import pybind11"], capture_output=True)
    assert missing.returncode != 0, "the fresh .venv should not see pybind11 before the set-up"

    # 3. The set-up from the bundle, with no registry and an apt that fails if called.
    bin_dir, apt_log = str(tmp_path / "bin"), str(tmp_path / "apt.log")
    _fake_apt(bin_dir, apt_log)
    # The extensions and one GoogleTest program (GTest linked from the bundle), not every test: CI's time. Built
    # unoptimized (RelWithDebInfo's flags replaced by -DNDEBUG alone: no -O, no -g, and pybind11 adds no LTO to that
    # build type): what is checked here is that the bundle builds it offline and that it runs, not its speed; the
    # release build (-O3, LTO) took about 1.7 times the CPU (Note [Precompiled torch headers] in bindings/).
    env = _offline_env(bin_dir, TIERFLOW_BUNDLE=str(bundle),
                       CMAKE_ARGS="-DTIERFLOW_BUILD_BENCHMARKS=OFF -DTIERFLOW_WITH_CUDA=OFF "
                                  "-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-DNDEBUG",
                       SETUP_TARGETS="_core _C test_core")
    done, log = _setup(repo, env)
    assert done.returncode == 0, log[-5000:]
    assert not os.path.exists(apt_log), "apt was called: " + open(apt_log).read()
    assert "unpacking" in log and "installing Python packages from" in log, log

    # The wheels came from the bundle, at the bundle's versions.
    listed_wheels = {canonicalize_name(os.path.basename(p).split("-")[0]): os.path.basename(p).split("-")[1]
                     for p in listed if p.endswith(".whl")}
    pip_list = run_child([vpy, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                         env=env, check=True).stdout
    installed = {canonicalize_name(d["name"]): d["version"] for d in json.loads(pip_list)}
    for name in WHEEL_PACKAGES:
        assert installed.get(canonicalize_name(name)) == listed_wheels[canonicalize_name(name)], (name, installed)

    # CMake found every library in the unpacked packages, not on the system.
    deps = os.path.join(repo, ".deps", "usr")
    cache = open(os.path.join(repo, "build", "dev", "CMakeCache.txt")).read()
    for var in ("TIERFLOW_LIBAIO_INCLUDE_DIR", "TIERFLOW_LIBAIO_LIBRARY", "TIERFLOW_XXHASH_INCLUDE_DIR",
                "TIERFLOW_XXHASH_LIBRARY", "TIERFLOW_MIMALLOC_LIB", "TBB_DIR", "GTest_DIR"):
        value = re.search(rf"^{var}:\w+=(.*)$", cache, re.M)
        assert value and value.group(1).startswith(deps), (var, value and value.group(1))

    # 4. From any directory, with no PYTHONPATH and no LD_LIBRARY_PATH: tierflow imports, trains a
    # step, and every native library it loads (mimalloc through dlopen too) comes from .deps.
    probe = textwrap.dedent("""
        import json, torch, tierflow, tierflow._C
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        model, optimizer = tierflow.wrap(model, torch.optim.AdamW(model.parameters()))
        model(torch.randn(512, 256)).sum().backward()
        optimizer.step()
        maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
        print(json.dumps({"init": tierflow.__file__, "C": tierflow._C.__file__, "maps": sorted(maps)}))
    """)
    run_env = {k: v for k, v in env.items() if k not in ("TIERFLOW_BUNDLE", "LD_LIBRARY_PATH")}
    ran = run_child([vpy, "-c", probe], cwd=str(tmp_path), env=run_env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen["init"] == os.path.join(repo, "bindings", "python", "tierflow", "__init__.py")
    assert seen["C"].startswith(os.path.join(repo, "bindings", "python", "tierflow", "_C"))
    for lib in LIBRARIES:
        paths = [p for p in seen["maps"] if os.path.basename(p).startswith(lib)]
        assert paths and all(p.startswith(deps) for p in paths), (lib, paths)

    # 5. A second set-up, now without the bundle, finds everything in place: nothing unpacked,
    # installed or configured, nothing rebuilt, apt still untouched.
    env.pop("TIERFLOW_BUNDLE")
    again, log = _setup(repo, env)
    assert again.returncode == 0, log[-5000:]
    for step in ("unpacking", "installing", "configuring", "creating"):
        assert step not in log, log
    assert "no work to do" in open(os.path.join(repo, "build", "dev", "setup-build.log")).read()
    assert os.access(os.path.join(repo, "build", "dev", "tests", "test_core"), os.X_OK), "GoogleTest from the bundle"
    assert not os.path.exists(apt_log), "apt was called: " + open(apt_log).read()
