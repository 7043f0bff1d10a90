#!/usr/bin/env bash
# The torch-free C++ suite under the sanitizers (make sanitize; CI runs it).
#
#   scripts/sanitize.sh [asan|tsan|all]     (default: all)
#
#   asan  build/asan: -fsanitize=address,undefined, every GoogleTest of the five
#         torch-free layers (core, allocator, swap, tiering, optimizer). Any
#         report fails the run: UBSan does not recover, ASan and LeakSanitizer
#         halt on the first error.
#   tsan  build/tsan: -fsanitize=thread, the suites that run threads of their
#         own (pinned pool, copy engine, NVMe engine, CPU Adam and the NVMe
#         optimizer). Any report not matched by tests/sanitizers/tsan.supp fails
#         the run; that file names each suppressed frame and why it is there.
#
# Both builds leave out torch (not instrumented, so bindings/ cannot be
# sanitized here) and the CUDA backend (nothing can run it on a machine without
# a GPU; the [cuda] cases run on a GPU node). Tests that cannot run under a
# sanitizer skip and say why (GTEST_SKIP with the reason). Durations are printed
# per job. Expects the packages `make setup` installs (it runs first via make).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf '[sanitize] %s\n' "$*"; }
die() { printf '[sanitize] error: %s\n' "$*" >&2; exit 1; }

jobs=${1:-all}
case "$jobs" in asan|tsan|all) ;; *) die "unknown job '$jobs': accepted are asan, tsan and all" ;; esac

export PATH="$ROOT/.venv/bin:$PATH"
prefix=()
[ -n "$(ls -A .deps/.unpacked 2>/dev/null)" ] && prefix=(-DCMAKE_PREFIX_PATH="$ROOT/.deps/usr")
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

part() {  # part NAME SECONDS: a row of .ci/run's table (scripts/timed.sh's format), when it keeps one
  [ -n "${CI_STEP_TIMES:-}" ] && printf '%s\t%d\tok\n' "$1" "$2" >>"$CI_STEP_TIMES"
  return 0
}

build() {  # build DIR SANITIZE OPT [TARGET...]: every target, or only those named; OPT: -O0 or -O1
  local dir=$1 san=$2 opt=$3; shift 3
  local targets=()
  (($#)) && targets=(--target "$@")
  mkdir -p "$dir"
  if [ ! -f "$dir/CMakeCache.txt" ]; then
    # ASan at -O0: reports as exact as at -O1, and the whole instrumented suite compiles in ~300 s of CPU
    # (CI's -O1 -g build: ~815 s), its tests taking ~30 s longer (67 s on two cores). TSan at
    # -O1, as the sanitizers' authors advise (its threaded suites are its slowest). -g1: line tables, all a
    # report's frames need (file and line), a fifth less CPU to compile than -g. (The SIMD kernels compile
    # at -O0 in both: optimizer/CMakeLists.txt.)
    cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt -g1 -DNDEBUG" \
      -DTIERFLOW_SANITIZE="$san" \
      -DTIERFLOW_BUILD_PYTHON=OFF -DTIERFLOW_WITH_CUDA=OFF -DTIERFLOW_BUILD_TESTS=ON \
      -DTIERFLOW_INSTALL=OFF "${prefix[@]}" >"$dir/configure.log" 2>&1 \
      || { cat "$dir/configure.log" >&2; rm -f "$dir/CMakeCache.txt"; die "configuring $dir failed"; }
  fi
  cmake --build "$dir" -j "$(nproc)" "${targets[@]}" >"$dir/build.log" 2>&1 \
    || { tail -n 40 "$dir/build.log" >&2; die "building $dir failed (log: $dir/build.log)"; }
}

run_ctest() {  # run_ctest DIR NAME [ctest args...]
  local dir=$1 name=$2; shift 2
  local t0=$SECONDS
  if ! (cd "$dir" && ctest --output-on-failure --timeout 300 -j "$(nproc)" "$@"); then
    die "$name: a test failed or a sanitizer reported (output above)"
  fi
  say "$name: passed in $((SECONDS - t0)) s"
  part "${name%% *} suite" "$((SECONDS - t0))"
}

if [ "$jobs" = asan ] || [ "$jobs" = all ]; then
  t0=$SECONDS
  build build/asan address,undefined -O0
  say "asan: built in $((SECONDS - t0)) s"
  part "asan build" "$((SECONDS - t0))"
  ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    run_ctest build/asan "asan (address,undefined; the whole torch-free suite)"
fi

if [ "$jobs" = tsan ] || [ "$jobs" = all ]; then
  t0=$SECONDS
  # Only the binaries of the suites it runs (below): test_tiering is torch-free
  # planning arithmetic on one thread, which ASan+UBSan covers.
  build build/tsan thread -O1 test_allocator test_swap test_optimizer
  say "tsan: built in $((SECONDS - t0)) s"
  part "tsan build" "$((SECONDS - t0))"
  # The suites whose code runs threads: the pinned pool (fenced frees), the
  # quarantine adaptor (threads allocating and freeing), the copy engines
  # (worker threads), the NVMe engine (its completion thread), the staged
  # pipeline over both (Note [Staged pipeline]) and the optimizers
  # (oneTBB kernels, the NVMe optimizer's pipeline, the step ledger its worker
  # and autograd's threads share under GradStream's lock).
  TSAN_OPTIONS="suppressions=$ROOT/tests/sanitizers/tsan.supp:halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0" \
    run_ctest build/tsan "tsan (pinned pool, quarantine adaptor, copy engines, NVMe engine, staged pipeline, CPU Adam)" \
      -R '^(PinnedHostPool|QuarantineAdaptor|CopyEngine|NvmeTest|NvmeAdamTest|EmulatedDevice/StagedPipelineTest|CpuAdam|PartialNormsTest|GradBuckets|StepLedger)\.'
fi
