#!/usr/bin/env bash
# Installs what tierflow needs on this machine, then builds it. Idempotent: a
# second run finds everything in place and only rebuilds what changed.
#
#   Debian packages  libaio-dev libtbb-dev libmimalloc-dev libxxhash-dev libgtest-dev libgmock-dev
#   Python           a virtual environment in .venv (it sees system site-packages, so a
#                    preinstalled torch on a GPU machine is used as is), torch 2.13.0
#                    when no torch is importable, pybind11, scikit-build-core, cmake,
#                    ninja, numpy, pytest
#   build            CMake + Ninja in build/dev: the C++ libraries, the GoogleTest
#                    suites and tierflow._C next to the Python sources
#
# With no package registry reachable (an air-gapped cluster, the GPU machine)
# nothing is downloaded when everything is already there; otherwise it stops
# and lists what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# ---- Debian packages ----------------------------------------------------------
DEB_PACKAGES=(libaio-dev libtbb-dev libmimalloc-dev libxxhash-dev libgtest-dev libgmock-dev)
missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "need root or sudo to install: ${missing[*]}"
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/tmp/tierflow-apt.log 2>&1; then
    tail -n 20 /tmp/tierflow-apt.log >&2
    die "could not install ${missing[*]} (no package registry reachable?). Install them by hand, then rerun."
  fi
fi

# ---- Python environment -------------------------------------------------------
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PYTHON" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python

need=()
"$VPY" -c "import torch" 2>/dev/null || need+=("torch==2.13.0")
for mod_pkg in pybind11:pybind11 scikit_build_core:scikit-build-core numpy:numpy pytest:pytest; do
  mod=${mod_pkg%%:*}; pkg=${mod_pkg#*:}
  "$VPY" -c "import $mod" 2>/dev/null || need+=("$pkg")
done
[ -x .venv/bin/cmake ] || command -v cmake >/dev/null || need+=("cmake")
[ -x .venv/bin/ninja ] || command -v ninja >/dev/null || need+=("ninja")
if ((${#need[@]})); then
  say "installing Python packages: ${need[*]}"
  "$VPY" -m pip install -q "${need[@]}" \
    || die "pip could not install ${need[*]} (no registry reachable?). Install them into .venv by hand, then rerun."
fi
say "torch $("$VPY" -c 'import torch; print(torch.__version__)')"

# ---- build ------------------------------------------------------------------------
export PATH="$PWD/.venv/bin:$PATH"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [ ! -f build/dev/CMakeCache.txt ]; then
  cmake -S . -B build/dev "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DTIERFLOW_BUILD_TESTS=ON \
        -DTIERFLOW_BUILD_BENCHMARKS=ON -DPython3_EXECUTABLE="$PWD/$VPY" >/tmp/tierflow-cmake.log 2>&1 \
    || { cat /tmp/tierflow-cmake.log >&2; die "CMake configuration failed"; }
  grep -E "tierflow:" /tmp/tierflow-cmake.log || true
fi
say "building (build/dev)"
cmake --build build/dev -j "$(nproc)" >/tmp/tierflow-build.log 2>&1 \
  || { tail -n 60 /tmp/tierflow-build.log >&2; die "build failed (full log: /tmp/tierflow-build.log)"; }
say "ready"
