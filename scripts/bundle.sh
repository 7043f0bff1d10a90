#!/usr/bin/env bash
# Downloads into one directory what building and testing tierflow needs beyond
# what a CUDA + torch machine already has, so that a machine with no package
# registry (a GPU node) can run the set-up from it:
#
#   make bundle [BUNDLE=dir]                  here, with the registries reachable
#   TIERFLOW_BUNDLE=dir make test             there (or make test BUNDLE=dir)
#
#   dir/debs/     Debian packages (bookworm names; apt-get download, no root)
#   dir/wheels/   wheels of pybind11, scikit-build-core, cmake, ninja, numpy,
#                 pytest, transformers, accelerate and peft (test dependencies, at scripts/setup.sh's
#                 pins; accelerate and peft without torch, which they name)
#                 and what they need (pip download --only-binary=:all:)
#   dir/MANIFEST.txt  every file with its sha256, written last: a bundle
#                 without it is incomplete and scripts/setup.sh refuses it
#
# torch is never bundled: the machine it is for has its own (CUDA) build.
#
# Settings (environment):
#   BUNDLE_PYTHON_VERSION  the Python version(s) the wheels are for, e.g.
#                          "3.12" or "3.11 3.12"; default: this machine's .venv
#                          (or python3). Another version gets manylinux wheels.
#   BUNDLE_PLATFORMS       manylinux tags for another version (default: glibc
#                          2.28 and older, which every torch 2.x node has)
#   BUNDLE_WHEELS          the pip requirements to bundle (default below);
#                          empty: Debian packages only
#   BUNDLE_WHEELS_NO_DEPS  requirements bundled without what they require
#                          (they name torch; default below)
#   BUNDLE_DEEPSPEED=1     also dir/deepspeed/: a DeepSpeed wheel built here
#                          from its source release (DeepSpeed publishes no
#                          wheels; its ops compile on first use) and what it
#                          requires beyond torch's image, for the benchmark's
#                          deepspeed-* peers; scripts/gpu_check.sh installs it
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

say() { printf '[bundle] %s\n' "$*"; }
die() { printf '[bundle] error: %s\n' "$*" >&2; exit 1; }

OUT=${1:-bundle}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# Runtime libraries with their -dev packages (the Debian packages scripts/setup.sh
# wants). Their other dependencies are either on every Debian/Ubuntu system or
# not needed to build and run tierflow; ALLOWED_ELSEWHERE says which and why.
DEBS=(libaio1 libaio-dev
      libtbb12 libtbb-dev libtbbmalloc2 libtbbbind-2-5
      libmimalloc2.0 libmimalloc-dev
      libxxhash0 libxxhash-dev
      nlohmann-json3-dev
      libgtest-dev libgmock-dev)
ALLOWED_ELSEWHERE=(libc6 libgcc-s1 libstdc++6   # the C and C++ runtimes every system has
                   googletest                   # GoogleTest's sources; libgtest-dev ships the built libraries
                   libhwloc15)                  # needed only by libtbbbind, which oneTBB loads if it can
WHEELS=${BUNDLE_WHEELS-pybind11 scikit-build-core cmake ninja numpy pytest pytest-xdist transformers==4.57.6 matplotlib}  # the pin: scripts/setup.sh's
# Packages that name torch as a requirement (a bundle carries no torch): downloaded without their requirements,
# the others listed with them (accelerate and peft need numpy, packaging, pyyaml, tqdm, huggingface_hub and
# safetensors, which transformers brings, and psutil).
WHEELS_NO_DEPS=${BUNDLE_WHEELS_NO_DEPS-accelerate==1.10.1 peft==0.17.1 psutil}  # the pins: scripts/setup.sh's

PY=python3
[ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip; set up .venv first (make setup) or install python3-pip"
PY_VERSIONS=${BUNDLE_PYTHON_VERSION:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
LOCAL_VERSION=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PLATFORMS=${BUNDLE_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64}

rm -f "$OUT/MANIFEST.txt"      # until the end, the bundle is incomplete
rm -rf "$OUT/debs" "$OUT/wheels" "$OUT/deepspeed"
mkdir -p "$OUT/debs" "$OUT/wheels"

# ---- Debian packages ------------------------------------------------------------
command -v apt-get >/dev/null || die "apt-get not found: make the bundle on a Debian/Ubuntu machine"
for p in "${DEBS[@]}"; do
  apt-cache show "$p" >/dev/null 2>&1 \
    || die "apt does not know the package $p: run 'apt-get update' (as root), then make bundle again"
done
# Check that the list is closed: every dependency is bundled or known to be elsewhere.
unlisted=()
while read -r dep; do
  [[ " ${DEBS[*]} ${ALLOWED_ELSEWHERE[*]} " == *" $dep "* ]] || unlisted+=("$dep")
done < <(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
           --no-enhances "${DEBS[@]}" | sed -n 's/^ *|\{0,1\}\(Pre\)\{0,1\}Depends: <\{0,1\}\([^ >:]*\).*/\2/p' | sort -u)
((${#unlisted[@]} == 0)) \
  || die "these dependencies of the bundled packages are neither bundled nor known to be elsewhere: ${unlisted[*]} (add them to DEBS or ALLOWED_ELSEWHERE in scripts/bundle.sh)"
say "downloading Debian packages: ${DEBS[*]}"
(cd "$OUT/debs" && apt-get download -q "${DEBS[@]}" >"$OUT/debs/.apt.log" 2>&1) \
  || { cat "$OUT/debs/.apt.log" >&2; die "apt-get download failed (is a Debian mirror reachable?)"; }
rm -f "$OUT/debs/.apt.log"

# ---- wheels -------------------------------------------------------------------------
if [ -n "$WHEELS" ]; then
  for v in $PY_VERSIONS; do
    target=()
    if [ "$v" != "$LOCAL_VERSION" ]; then
      target=(--python-version "$v" --implementation cp --abi "cp${v/./}")
      for plat in $PLATFORMS; do target+=(--platform "$plat"); done
    fi
    say "downloading wheels for Python $v: $WHEELS"
    # shellcheck disable=SC2086  # WHEELS is a list of requirements
    "$PY" -m pip download -q --only-binary=:all: --dest "$OUT/wheels" "${target[@]}" $WHEELS \
      || die "pip could not download wheels for Python $v (is PyPI reachable? for another Python, are BUNDLE_PLATFORMS right?)"
    if [ -n "$WHEELS_NO_DEPS" ]; then
      # shellcheck disable=SC2086
      "$PY" -m pip download -q --only-binary=:all: --no-deps --dest "$OUT/wheels" "${target[@]}" $WHEELS_NO_DEPS \
        || die "pip could not download $WHEELS_NO_DEPS for Python $v"
    fi
  done
  if compgen -G "$OUT/wheels/torch-*" >/dev/null || compgen -G "$OUT/wheels/nvidia_*" >/dev/null; then
    die "a bundled package pulled in torch or CUDA wheels; the bundle must not carry torch: check BUNDLE_WHEELS"
  fi
fi

# ---- DeepSpeed (opt-in) ---------------------------------------------------------------
# Its requirements that a CUDA torch image lacks (torch, numpy, packaging, psutil and tqdm it has). None of them
# requires torch, so they are resolved together (pydantic pins the pydantic-core it needs); DeepSpeed itself
# goes in without its requirements (it names torch).
DEEPSPEED_REQUIRES="hjson py-cpuinfo msgpack nvidia-ml-py einops ninja pydantic"
if [ "${BUNDLE_DEEPSPEED:-0}" = 1 ]; then
  mkdir -p "$OUT/deepspeed"
  "$PY" -c 'import torch' 2>/dev/null || die "BUNDLE_DEEPSPEED: building DeepSpeed's wheel needs torch in $PY"
  say "building a DeepSpeed wheel from its source release"
  "$PY" -m pip download -q --no-deps --no-binary=:all: --dest "$OUT/deepspeed/src" deepspeed \
    || die "pip could not download DeepSpeed's source release"
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/deepspeed" "$OUT"/deepspeed/src/deepspeed-*.tar.gz \
    || die "DeepSpeed's wheel did not build"
  rm -rf "$OUT/deepspeed/src"
  for v in $PY_VERSIONS; do
    target=()
    if [ "$v" != "$LOCAL_VERSION" ]; then
      target=(--python-version "$v" --implementation cp --abi "cp${v/./}")
      for plat in $PLATFORMS; do target+=(--platform "$plat"); done
    fi
    # shellcheck disable=SC2086  # a list of requirements
    "$PY" -m pip download -q --only-binary=:all: --dest "$OUT/deepspeed" "${target[@]}" $DEEPSPEED_REQUIRES \
      || die "pip could not download DeepSpeed's requirements for Python $v"
  done
fi

# ---- manifest -----------------------------------------------------------------------
{
  echo "# tierflow bundle, made by scripts/bundle.sh on $(date -u +%Y-%m-%dT%H:%MZ) ($(. /etc/os-release && echo "$PRETTY_NAME"), $(dpkg --print-architecture))"
  echo "# use it with: TIERFLOW_BUNDLE=<this directory> make test   (or make setup BUNDLE=<this directory>)"
  echo "# Debian packages, unpacked with dpkg -x into .deps/: ${DEBS[*]}"
  if [ -n "$WHEELS" ]; then
    echo "# wheels for Python ${PY_VERSIONS}: ${WHEELS} (and what they need), ${WHEELS_NO_DEPS}; torch is not bundled"
  else
    echo "# no wheels (BUNDLE_WHEELS was empty)"
  fi
  if [ -d "$OUT/deepspeed" ]; then echo "# deepspeed/: a DeepSpeed wheel and its requirements beyond torch's image: ${DEEPSPEED_REQUIRES}"; fi
  echo "# sha256 and path of every file (check: grep -v '^#' MANIFEST.txt | sha256sum -c):"
  (cd "$OUT" && find debs wheels $([ -d deepspeed ] && echo deepspeed) -type f | LC_ALL=C sort | xargs -r sha256sum)
} >"$OUT/MANIFEST.txt.tmp"
mv "$OUT/MANIFEST.txt.tmp" "$OUT/MANIFEST.txt"
say "$(find "$OUT/debs" -name '*.deb' | wc -l) Debian packages, $(find "$OUT/wheels" -name '*.whl' | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT"
