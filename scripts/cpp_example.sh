#!/usr/bin/env bash
# `make cpp-example`: installs tierflow's C++ package into a prefix inside the
# build tree, builds examples/cpp_trainer against that INSTALLED package (its
# CMake sees the prefix and LibTorch, never build/dev), and runs the trainer
# with each activation plan: blocks swapped to the host, swapped to NVMe (with
# the optimizer states on NVMe too), recomputed; the CPU AdamW stepping during
# backward (TIERFLOW_OVERLAP_STEP=on) and after it; the blocks' parameters on
# the host between uses; TIERFLOW_OFFLOAD_ACTIVATIONS=auto (the plan driver's
# plan from the third step); and with torch's own AdamW, where the losses must be
# bit-identical to plain LibTorch. Each plan
# runs on the emulated device in both of its modes (Note [Adversarial emulated
# device]), or on CUDA where torch sees a GPU. Run after scripts/setup.sh.
set -euo pipefail

say() { printf '[cpp-example] %s\n' "$*"; }
die() { printf '[cpp-example] error: %s\n' "$*" >&2; exit 1; }

cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_DIR=build/dev
PREFIX=$ROOT/$BUILD_DIR/install
EXAMPLE_BUILD=$ROOT/$BUILD_DIR/cpp_trainer
VPY=.venv/bin/python
export PATH="$ROOT/.venv/bin:$PATH"
[ -f "$BUILD_DIR/CMakeCache.txt" ] || die "$BUILD_DIR is not configured: run 'make setup' first"

say "installing tierflow into $PREFIX"
rm -rf "$PREFIX"
cmake --install "$BUILD_DIR" --prefix "$PREFIX" >"$BUILD_DIR/cpp-example-install.log" \
  || { cat "$BUILD_DIR/cpp-example-install.log" >&2; die "cmake --install failed"; }

# The example finds tierflow in the prefix, Torch in the wheel, and the
# Debian packages where the main build found them (.deps/usr from a bundle).
TORCH_PREFIX=$("$VPY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
DEPS_PREFIX=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt")
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
rm -rf "$EXAMPLE_BUILD"
say "configuring examples/cpp_trainer against the installed package"
cmake -S examples/cpp_trainer -B "$EXAMPLE_BUILD" "${GENERATOR[@]}" \
      -DCMAKE_PREFIX_PATH="$PREFIX;$TORCH_PREFIX${DEPS_PREFIX:+;$DEPS_PREFIX}" \
      -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON >"$EXAMPLE_BUILD.log" 2>&1 \
  || { cat "$EXAMPLE_BUILD.log" >&2; die "configuring the example failed"; }
grep "cpp_trainer: tierflow" "$EXAMPLE_BUILD.log" | sed 's/^-- /[cpp-example] /'
grep -q "from $PREFIX/" "$EXAMPLE_BUILD.log" || die "the example did not find tierflow in $PREFIX"
say "building the example"
cmake --build "$EXAMPLE_BUILD" -j "$(nproc)" >>"$EXAMPLE_BUILD.log" 2>&1 \
  || { tail -n 40 "$EXAMPLE_BUILD.log" >&2; die "building the example failed (log: $EXAMPLE_BUILD.log)"; }

# TIERFLOW_* settings of the caller go to the trainer, except the ones each run sets.
NVME_DIR=$EXAMPLE_BUILD/nvme
mkdir -p "$NVME_DIR"
run() {  # run NAME [VAR=value ...] -- ARGS...
  local name=$1; shift
  local vars=()
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  say "$name"
  env "${vars[@]}" "$EXAMPLE_BUILD/cpp_trainer" "$@" || die "$name failed"
}
NVME=(TIERFLOW_OFFLOAD_ACTIVATIONS=nvme TIERFLOW_OFFLOAD_OPTIMIZER=nvme TIERFLOW_NVME_PATHS="$NVME_DIR"
      TIERFLOW_NVME_MEMORY=256MiB)
if "$VPY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  MODES=(cuda)
  EXACT_TOLERANCE=1e-6   # CUDA kernels (atomics) need not repeat bit for bit
  EXACT_ENV=()
else
  MODES=(polite adversarial)
  EXACT_TOLERANCE=0
  # MKL's sgemm (torch's CPU BLAS) may round differently with the alignment of
  # its inputs and the threads it picks under load, so two runs of the same
  # matmul in one process can differ by an ulp: 5 of 40 runs of the exact
  # comparison failed that way, tierflow's code old and new alike, and 0 of 28
  # with MKL's reproducible mode (AUTO,STRICT: 2 of 16). As CUBLAS_WORKSPACE_CONFIG
  # for cuBLAS in the Python tests, it makes the comparison see tierflow only.
  EXACT_ENV=(MKL_CBWR=COMPATIBLE)
fi
# A device budget that holds the model, a block's working set, a 1 MiB prefetch window and some of the
# blocks' saved activations, not all of them (keeping all 4 blocks needs 16.9 MiB here).
SMALL_GPU=12MiB
for mode in "${MODES[@]}"; do
  DEV=(TIERFLOW_EMULATED_DEVICE=$mode)
  [ "$mode" = cuda ] && DEV=(TIERFLOW_DEVICE=auto)
  run "$mode: blocks swapped to the host, CPU AdamW stepping during backward" "${DEV[@]}" -- --activations host
  run "$mode: blocks swapped to the host, CPU AdamW stepping after backward" "${DEV[@]}" TIERFLOW_OVERLAP_STEP=off -- \
      --activations host
  run "$mode: blocks swapped to NVMe, CPU AdamW with states on NVMe" "${DEV[@]}" "${NVME[@]}" -- --activations config
  run "$mode: blocks recomputed, CPU AdamW stepping during backward" "${DEV[@]}" -- --activations recompute
  run "$mode: blocks swapped to the host, their parameters on the host between uses, CPU AdamW stepping during backward" \
      "${DEV[@]}" -- --activations host --params host
  run "$mode: blocks swapped to the host, their parameters on the host between uses, torch's AdamW (bit-identical)" \
      "${DEV[@]}" "${EXACT_ENV[@]}" -- --activations host --params host --optimizer torch --tolerance "$EXACT_TOLERANCE"
  run "$mode: blocks swapped to the host, torch's AdamW (bit-identical)" "${DEV[@]}" "${EXACT_ENV[@]}" -- \
      --activations host --optimizer torch --tolerance "$EXACT_TOLERANCE"
  if [ "$mode" = cuda ]; then  # Note [C++ GPU share]: a quarter of the parameters step on the GPU, the rest stream
    run "$mode: blocks swapped to the host, a GPU share of 0.25, CPU AdamW stepping the rest during backward" \
        "${DEV[@]}" TIERFLOW_GPU_OPTIMIZER_FRACTION=0.25 -- --activations host
  fi
  # Note [C++ auto activations]: the plan driver profiles two steps and plans before the third.
  AUTO=(TIERFLOW_OFFLOAD_ACTIVATIONS=auto)
  run "$mode: auto activations, CPU AdamW stepping during backward" "${DEV[@]}" "${AUTO[@]}" -- --activations auto
  run "$mode: auto activations under TIERFLOW_GPU_MEMORY=$SMALL_GPU, their parameters on the host, CPU AdamW stepping during backward" \
      "${DEV[@]}" "${AUTO[@]}" TIERFLOW_GPU_MEMORY=$SMALL_GPU TIERFLOW_PREFETCH_BYTES=1MiB -- --activations auto --params host
  run "$mode: auto activations under TIERFLOW_GPU_MEMORY=$SMALL_GPU, torch's AdamW (bit-identical)" "${DEV[@]}" \
      "${EXACT_ENV[@]}" "${AUTO[@]}" TIERFLOW_GPU_MEMORY=$SMALL_GPU TIERFLOW_PREFETCH_BYTES=1MiB -- --activations auto --optimizer torch \
      --tolerance "$EXACT_TOLERANCE"
done
say "all runs passed"
