#!/usr/bin/env bash
# Installs what tierflow needs on this machine, then builds it. Idempotent: a
# second run finds everything in place and only rebuilds what changed.
#
#   Debian packages  libaio-dev libtbb-dev libmimalloc-dev libxxhash-dev nlohmann-json3-dev libgtest-dev libgmock-dev
#   Python           a virtual environment in .venv (it sees system site-packages, so a
#                    preinstalled torch on a GPU machine is used as is), torch 2.13.0
#                    when no torch is importable, pybind11, scikit-build-core, cmake,
#                    ninja, numpy, pytest, pytest-xdist (make test's two workers; optional), transformers 4.57.6, accelerate 1.10.1 and peft
#                    0.17.1 (test dependencies: the HF model, model zoo and Trainer tests), matplotlib (the timeline); a .pth file makes `import tierflow` find
#                    bindings/python from any directory
#   build            CMake + Ninja in build/dev: the C++ libraries, the GoogleTest
#                    suites and the extensions tierflow._core (torch-free) and tierflow._C next
#                    to the Python sources
#
# With TIERFLOW_BUNDLE=dir (make setup BUNDLE=dir), a directory made by
# `make bundle` (scripts/bundle.sh), no registry is used: its Debian packages
# are unpacked into .deps/ (no root needed), CMake finds them there through
# CMAKE_PREFIX_PATH, the binaries find them through their run path, and the
# Python packages that .venv lacks are installed from its wheels. Later runs
# keep using .deps/, with or without TIERFLOW_BUNDLE.
#
# With no package registry reachable and no bundle, nothing is downloaded when
# everything is already there; otherwise it stops and lists what is missing.
#
# CMAKE_ARGS adds CMake options (e.g. -DTIERFLOW_BUILD_TESTS=OFF), as for pip install .;
# the build directory is configured again whenever its options change.
set -euo pipefail

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

BUNDLE=""
if [ -n "${TIERFLOW_BUNDLE:-}" ]; then   # relative to where the command was run
  [ -d "$TIERFLOW_BUNDLE" ] || die "TIERFLOW_BUNDLE=$TIERFLOW_BUNDLE is not a directory (make one with 'make bundle' on a machine with a registry)"
  BUNDLE=$(cd "$TIERFLOW_BUNDLE" && pwd)
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_DIR=build/dev
DEPS=.deps                # prefix of the Debian packages unpacked from a bundle
mkdir -p "$BUILD_DIR"     # holds the logs too

# ---- the bundle's Debian packages, unpacked into .deps ---------------------------
unpack_deb() {  # unpack_deb PKG.deb PREFIX: dpkg -x, or ar + tar where there is no dpkg
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$1" "$2"
  else
    local tmp member; tmp=$(mktemp -d)
    member=$(cd "$tmp" && ar t "$1" | grep '^data\.tar') && (cd "$tmp" && ar x "$1" "$member") \
      && tar -xf "$tmp/$member" -C "$2"; local rc=$?; rm -rf "$tmp"; return $rc
  fi
}
if [ -n "$BUNDLE" ]; then
  [ -f "$BUNDLE/MANIFEST.txt" ] \
    || die "$BUNDLE has no MANIFEST.txt: it is not a bundle, or 'make bundle' did not finish; make it again"
  (cd "$BUNDLE" && grep -v '^#' MANIFEST.txt | sha256sum --check --quiet --strict) >"$BUILD_DIR/setup-bundle.log" 2>&1 \
    || { cat "$BUILD_DIR/setup-bundle.log" >&2; die "files of $BUNDLE differ from its MANIFEST.txt (copied in part?); copy or make it again"; }
  say "using the bundle $BUNDLE (no registry)"
  mkdir -p "$DEPS/.unpacked"
  for deb in "$BUNDLE"/debs/*.deb; do
    [ -e "$deb" ] || continue
    base=$(basename "$deb"); pkg=${base%%_*}
    if [ "$(cat "$DEPS/.unpacked/$pkg" 2>/dev/null)" != "$base" ]; then
      say "unpacking $base into $DEPS/"
      unpack_deb "$deb" "$ROOT/$DEPS" || die "could not unpack $deb"
      echo "$base" >"$DEPS/.unpacked/$pkg"
    fi
  done
fi
USE_DEPS=false
[ -n "$(ls -A "$DEPS/.unpacked" 2>/dev/null)" ] && USE_DEPS=true

# ---- Debian packages ------------------------------------------------------------------
DEB_PACKAGES=(libaio-dev libtbb-dev libmimalloc-dev libxxhash-dev nlohmann-json3-dev libgtest-dev libgmock-dev)
have_deb() {  # installed on the system, or unpacked from a bundle into .deps
  [ -e "$DEPS/.unpacked/$1" ] || dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}
missing=()
for p in "${DEB_PACKAGES[@]}"; do have_deb "$p" || missing+=("$p"); done
if ((${#missing[@]})); then
  [ -z "$BUNDLE" ] || die "the bundle $BUNDLE lacks the Debian packages ${missing[*]}; make it again with 'make bundle'"
  say "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "need root or sudo to install: ${missing[*]} (or, without root: TIERFLOW_BUNDLE=dir from 'make bundle')"
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >build/setup-apt.log 2>&1; then
    tail -n 20 build/setup-apt.log >&2
    die "could not install ${missing[*]} (no package registry reachable?). Install them by hand, or run 'make bundle' on a machine with a registry, copy bundle/ here and run 'TIERFLOW_BUNDLE=bundle make test'."
  fi
fi

# ---- Python environment -------------------------------------------------------
PYTHON=${PYTHON:-python3}
VPY=.venv/bin/python
if [ ! -x "$VPY" ]; then
  say "creating .venv"
  # An interpreter without ensurepip (a GPU image's, say) still makes a venv without pip: with a
  # bundle and everything importable, none is needed, and the parent's pip comes through the .pth below.
  "$PYTHON" -m venv --system-site-packages .venv >build/setup-venv.log 2>&1 \
    || { rm -rf .venv; say "venv with pip failed (no ensurepip?); making it without pip";
         "$PYTHON" -m venv --system-site-packages --without-pip .venv; }
  # A python3 that is itself a virtual environment (a GPU image's, say) does not
  # pass its own packages (torch) on through --system-site-packages; a .pth does.
  parent_site=$("$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
  if [ -n "$parent_site" ]; then
    echo "$parent_site" >"$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_tierflow_parent_env.pth"
  fi
fi

need=()
if ! "$VPY" -c "import torch" 2>/dev/null; then
  [ -z "$BUNDLE" ] || die "torch is not importable by .venv/bin/python, and a bundle carries no torch (the machine should have its own, e.g. a CUDA build). Install torch for $PYTHON, or remove .venv and rerun with PYTHON=<an interpreter that has torch>."
  need+=("torch==2.13.0")
fi
# transformers, accelerate (which transformers' Trainer needs) and peft: test dependencies (tests/python/test_hf_models.py,
# test_model_zoo.py, test_hf_trainer.py), pinned; scripts/bundle.sh carries the same pins. matplotlib: the timeline
# picture (python -m tierflow timeline; tests/python/test_trace.py).
for mod_pkg in pybind11:pybind11 scikit_build_core:scikit-build-core numpy:numpy pytest:pytest \
               transformers:transformers==4.57.6 psutil:psutil matplotlib:matplotlib; do
  mod=${mod_pkg%%:*}; pkg=${mod_pkg#*:}
  "$VPY" -c "import $mod" 2>/dev/null || need+=("$pkg")
done
# accelerate and peft name torch as a requirement: they go in without their requirements (what else they need
# comes with transformers, and psutil above), so pip never tries to install or upgrade torch, or what torch
# requires, from a bundle that carries no torch.
no_deps=()
for mod_pkg in accelerate:accelerate==1.10.1 peft:peft==0.17.1; do
  mod=${mod_pkg%%:*}; pkg=${mod_pkg#*:}
  "$VPY" -c "import $mod" 2>/dev/null || no_deps+=("$pkg")
done
[ -x .venv/bin/cmake ] || command -v cmake >/dev/null || need+=("cmake")
[ -x .venv/bin/ninja ] || command -v ninja >/dev/null || need+=("ninja")
pip_install() {  # pip_install [pip options] PACKAGES: from the bundle only when there is one
  if [ -n "$BUNDLE" ]; then
    # Only the bundle: no index, and no find-links or index from pip's configuration.
    env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
      "$VPY" -m pip install -q --no-index --find-links "$BUNDLE/wheels" "$@"
  else
    "$VPY" -m pip install -q "$@"
  fi
}
for group in need no_deps; do
  declare -n pkgs=$group
  ((${#pkgs[@]})) || continue
  options=()
  [ "$group" = no_deps ] && options=(--no-deps)
  if [ -n "$BUNDLE" ]; then
    say "installing Python packages from $BUNDLE/wheels: ${pkgs[*]}"
    pip_install "${options[@]}" "${pkgs[@]}" \
      || die "the bundle's wheels do not provide ${pkgs[*]} for Python $("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') (made for another Python? make it with BUNDLE_PYTHON_VERSION=<this version> make bundle)"
  else
    say "installing Python packages: ${pkgs[*]}"
    pip_install "${options[@]}" "${pkgs[@]}" \
      || die "pip could not install ${pkgs[*]} (no registry reachable?). Install them into .venv by hand, or run 'make bundle' on a machine with a registry and 'TIERFLOW_BUNDLE=bundle make test' here."
  fi
done
# pytest-xdist: make test's two workers. Optional: without it (an older bundle) make test runs in one process.
if ! "$VPY" -c "import xdist" 2>/dev/null; then
  if pip_install pytest-xdist >"$BUILD_DIR/setup-xdist.log" 2>&1; then
    say "installed pytest-xdist"
  else
    say "pytest-xdist is not installed and could not be (log: $BUILD_DIR/setup-xdist.log): make test runs pytest in one process"
  fi
fi
say "torch $("$VPY" -c 'import torch; print(torch.__version__)')"

# `import tierflow` from any directory: the sources (and _core and _C, built next to
# them) go on .venv's path, an editable install that needs no second build.
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$(cat "$SITE/_tierflow_source.pth" 2>/dev/null)" != "$ROOT/bindings/python" ]; then
  echo "$ROOT/bindings/python" >"$SITE/_tierflow_source.pth"
fi

# ---- build ------------------------------------------------------------------------
export PATH="$PWD/.venv/bin:$PATH"
CONFIG=(-DCMAKE_BUILD_TYPE=Release -DTIERFLOW_BUILD_TESTS=ON -DTIERFLOW_BUILD_BENCHMARKS=ON
        -DPython3_EXECUTABLE="$ROOT/$VPY")
command -v ninja >/dev/null && CONFIG=(-G Ninja "${CONFIG[@]}")
$USE_DEPS && CONFIG+=(-DCMAKE_PREFIX_PATH="$ROOT/$DEPS/usr")
read -r -a extra <<<"${CMAKE_ARGS:-}"
CONFIG+=("${extra[@]}")
# The options of the last configuration are kept beside the cache: when they
# differ (a prefix added, say), the cache and every search result in it go.
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ] || [ "$(cat "$BUILD_DIR/setup-configure.txt" 2>/dev/null)" != "$(printf '%s\n' "${CONFIG[@]}")" ]; then
  if cmake --help | grep -q -- --fresh; then CONFIG=(--fresh "${CONFIG[@]}"); else rm -f "$BUILD_DIR/CMakeCache.txt"; fi
  say "configuring $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" "${CONFIG[@]}" >"$BUILD_DIR/setup-cmake.log" 2>&1 \
    || { cat "$BUILD_DIR/setup-cmake.log" >&2; rm -f "$BUILD_DIR/setup-configure.txt"; die "CMake configuration failed"; }
  [ "${CONFIG[0]}" != --fresh ] || CONFIG=("${CONFIG[@]:1}")
  printf '%s\n' "${CONFIG[@]}" >"$BUILD_DIR/setup-configure.txt"
  grep -E "tierflow:" "$BUILD_DIR/setup-cmake.log" || true
fi
# SETUP_TARGETS (space-separated CMake targets, e.g. "_core _C"): build only those; default: everything. (Not
# TIERFLOW_*: tierflow refuses a TIERFLOW_* variable it does not know, and set-up's environment reaches its runs.)
read -r -a targets <<<"${SETUP_TARGETS:-}"
say "building ($BUILD_DIR${targets[0]:+: ${targets[*]}})"
cmake --build "$BUILD_DIR" -j "$(nproc)" ${targets[0]:+--target "${targets[@]}"} >"$BUILD_DIR/setup-build.log" 2>&1 \
  || { tail -n 60 "$BUILD_DIR/setup-build.log" >&2; die "build failed (full log: $BUILD_DIR/setup-build.log)"; }

found=$(cd / && env -u PYTHONPATH "$ROOT/$VPY" -c 'import importlib.util as u; print(u.find_spec("tierflow").origin)' 2>/dev/null || true)
[ "$found" = "$ROOT/bindings/python/tierflow/__init__.py" ] \
  || say "warning: 'import tierflow' in .venv finds ${found:-nothing}, not $ROOT/bindings/python (an installed copy? pip uninstall tierflow)"
say "ready"
