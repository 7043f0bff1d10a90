#!/usr/bin/env bash
# `make gpu-check`: everything a session lent a GPU must measure, in one
# command (docs/gpu.md#one-command-on-a-gpu-node). On a machine with a CUDA
# GPU and torch, and no package registry, it
#   build   builds tierflow from the offline bundle (scripts/setup.sh with
#           TIERFLOW_BUNDLE, CUDA for this GPU's architecture),
#   tests   runs the C++ suite (CUDA copy engine and AdamW included) and
#           every [cuda] test case of the Python suite, in the adversarial
#           emulated mode (the [emulated] cases stay to CI); each failure is
#           written to tests-cuda-failures.log as it happens,
#   bench   runs benchmarks/bench_gpu_offload.py --preset gpt1b in every mode
#           (the auto modes, the CPU-optimizer modes, tierflow-params,
#           deepspeed-offload and deepspeed-zero3-offload when its wheel is
#           installed, --seq-search), writing benchmarks/results/gpu_offload.json,
#   seq     (opt-in, not in the default parts) issue 17's longest sequence alone:
#           --preset gpt1b --modes baseline --seq-search within GPU_CHECK_SEQ_SECONDS,
#           writing benchmarks/results/gpu_offload_seq.json (a command of its own in a lease),
#   cpp     (opt-in, not in the default parts) make cpp-example on CUDA: the C++ trainer's plans, auto,
#           steps during backward, parameters on the host and the GPU share against plain LibTorch,
#   bench7b (opt-in, not in the default parts) issue 18's target: --preset
#           llama7b, tierflow-params within 16GiB and deepspeed-zero3-offload,
#           writing benchmarks/results/gpu_offload_llama7b.json,
# and prints a one-screen summary. Each part logs into GPU_CHECK_OUT.
#
# Settings (environment):
#   GPU_CHECK_PARTS   the parts to run, in order (default "build tests bench");
#                     a 10-minute command fits "build tests", then "bench";
#                     "bench7b" on its own
#   GPU_CHECK_OUT     where logs and the summary go (default build/gpu-check)
#   GPU_CHECK_BENCH_ARGS  more arguments for bench_gpu_offload.py (e.g. --modes a,b to run fewer)
#   GPU_CHECK_SEQ_SEARCH  0 leaves out the bench's --seq-search (default 1)
#   GPU_CHECK_SEQ_SECONDS the seq part's search time, both modes together (default 400)
#   GPU_CHECK_PYTEST_ARGS more arguments for the [cuda] cases' pytest (e.g. "-n 8" with pytest-xdist)
#   GPU_CHECK_DRY_RUN=1   print what would run, run nothing (no GPU needed)
#   TIERFLOW_BUNDLE   the offline bundle (`make bundle`); default bundle/ when it exists
# Exit status: 0 when every part ran and passed; 1 when a part failed (the
# summary says which, and the later parts still run); 2 for a usage error or
# no GPU.
set -uo pipefail

say() { printf '[gpu-check] %s\n' "$*"; }
die() { printf '[gpu-check] error: %s\n' "$*" >&2; exit 2; }

cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${GPU_CHECK_OUT:-build/gpu-check}
PARTS=${GPU_CHECK_PARTS:-build tests bench}
DRY=${GPU_CHECK_DRY_RUN:-0}
BUNDLE=${TIERFLOW_BUNDLE:-}
[ -z "$BUNDLE" ] && [ -d bundle ] && BUNDLE=bundle
# The set-up's variable only (given to it below): tierflow refuses TIERFLOW_* variables it does not know,
# and the tests and the benchmark would inherit it (the C++ Config tests and every benchmark mode failed so).
unset TIERFLOW_BUNDLE
VPY=.venv/bin/python
RESULT=benchmarks/results/gpu_offload.json
SEQ_SEARCH=--seq-search
[ "${GPU_CHECK_SEQ_SEARCH:-1}" = 0 ] && SEQ_SEARCH=
RESULT7B=benchmarks/results/gpu_offload_llama7b.json
RESULTSEQ=benchmarks/results/gpu_offload_seq.json

for p in $PARTS; do
  case "$p" in build|tests|bench|seq|bench7b|cpp) ;;
    *) die "GPU_CHECK_PARTS: '$p' is not a part; accepted: build, tests, bench, seq, bench7b, cpp" ;; esac
done

# A GPU, seen by the driver; torch must see it too once it is installed.
if [ "$DRY" != 1 ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
    || die "no CUDA GPU here (nvidia-smi lists none): gpu-check measures what only a GPU can; CI runs the rest (make test)"
fi
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
failed=()

# run PART LOG COMMAND...: runs (or prints) one part's command, logging it, timing it.
run() {
  local part=$1 log=$2; shift 2
  if [ "$DRY" = 1 ]; then
    say "would run ($part): $*"
    return 0
  fi
  say "$part: $* (log: $log)"
  local t0=$SECONDS rc=0
  "$@" >"$log" 2>&1 || rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then
    echo "$part: passed in ${took}s" >>"$SUMMARY"
  else
    echo "$part: FAILED (exit $rc) after ${took}s; last lines of $log:" >>"$SUMMARY"
    tail -n 15 "$log" | sed 's/^/    /' >>"$SUMMARY"
    failed+=("$part")
  fi
  return 0
}

# DeepSpeed, the benchmarks' peer, from the bundle (BUNDLE_DEEPSPEED=1 make bundle) when the machine lacks it.
installed_deepspeed=0
install_deepspeed() {
  [ "$installed_deepspeed" = 1 ] && return 0
  installed_deepspeed=1
  if [ -n "$BUNDLE" ] && [ -d "$BUNDLE/deepspeed" ] && ! "$VPY" -c 'import deepspeed' 2>/dev/null; then
    # Only what this Python takes (the bundle may hold wheels for several): DeepSpeed without its requirements
    # (it names torch, which the machine has), then those it needs beyond the image, resolved from the bundle.
    run deepspeed "$OUT/deepspeed.log" bash -c "'$VPY' -m pip install -q --no-index --find-links '$BUNDLE/deepspeed' \
      --no-deps deepspeed && '$VPY' -m pip install -q --no-index --find-links '$BUNDLE/deepspeed' \
      hjson py-cpuinfo msgpack nvidia-ml-py einops ninja pydantic"
  fi
}

for part in $PARTS; do
  case "$part" in
    build)
      # The GPU's own architecture: nvcc's "native" needs a GPU at configure time, which this machine has.
      run build "$OUT/build.log" env TIERFLOW_BUNDLE="$BUNDLE" \
        CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native ${CMAKE_ARGS:-}" bash scripts/setup.sh
      ;;
    tests)
      # shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is a list of arguments
      run tests-cpp "$OUT/tests-cpp.log" ctest --test-dir build/dev --output-on-failure -j 8
      run tests-cuda "$OUT/tests-cuda.log" env TIERFLOW_EMULATED_DEVICE=adversarial PYTHONPATH="$ROOT/bindings/python" \
        GPU_CHECK_FAILURE_LOG="$OUT/tests-cuda-failures.log" \
        "$VPY" -m pytest tests/python -q -rs -k cuda --junitxml "$OUT/tests-cuda.xml" ${GPU_CHECK_PYTEST_ARGS:-}
      ;;
    bench)
      install_deepspeed
      # shellcheck disable=SC2086  # SEQ_SEARCH and GPU_CHECK_BENCH_ARGS are lists of arguments
      run bench "$OUT/bench.log" env PYTHONPATH="$ROOT/bindings/python" "$VPY" benchmarks/bench_gpu_offload.py \
        --preset gpt1b $SEQ_SEARCH --mode-timeout 300 --out "$RESULT" ${GPU_CHECK_BENCH_ARGS:-}
      ;;
    seq)
      # shellcheck disable=SC2086
      run seq "$OUT/seq.log" env PYTHONPATH="$ROOT/bindings/python" "$VPY" benchmarks/bench_gpu_offload.py \
        --preset gpt1b --modes baseline --seq-search --seq-search-seconds "${GPU_CHECK_SEQ_SECONDS:-400}" \
        --mode-timeout 120 --out "$RESULTSEQ" ${GPU_CHECK_BENCH_ARGS:-}
      ;;
    bench7b)
      install_deepspeed  # its peer, deepspeed-zero3-offload (the first H200 lease installed it by hand)
      # shellcheck disable=SC2086
      run bench7b "$OUT/bench7b.log" env PYTHONPATH="$ROOT/bindings/python" "$VPY" benchmarks/bench_gpu_offload.py \
        --preset llama7b --modes tierflow-params,deepspeed-zero3-offload --mode-timeout 280 --out "$RESULT7B" \
        ${GPU_CHECK_BENCH_ARGS:-}
      ;;
    cpp)
      run cpp "$OUT/cpp.log" bash scripts/cpp_example.sh
      ;;
  esac
done

[ "$DRY" = 1 ] && exit 0
{
  echo
  if [ -f "$OUT/tests-cuda.log" ]; then
    echo "[cuda] cases: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/tests-cuda.log" | tail -n 1)"
  fi
  if [ -f "$RESULT" ] && [[ " $PARTS " == *" bench "* ]]; then
    echo "benchmark ($RESULT):"
    PYTHONPATH="$ROOT/benchmarks" "$VPY" -c 'import json, sys
from gpu_offload_report import print_table
print_table(json.load(open(sys.argv[1])))' "$RESULT" 2>&1 | tail -n 30
  fi
  if [ -f "$RESULTSEQ" ] && [[ " $PARTS " == *" seq "* ]]; then
    echo "issue 17's longest sequence ($RESULTSEQ):"
    "$VPY" -c 'import json, sys
d = json.load(open(sys.argv[1]))["longest_seq"]
for m in ("checkpoint", "tierflow-auto-fits"):
    r = d.get(m, {})
    print("  %s: sequence %s, %s tokens/s, stopped: %s" % (m, r.get("seq"), r.get("tokens_per_second"), r.get("stopped")))
print("  planner / checkpoint: sequence x%s, tokens/s x%s" % (d.get("seq_ratio"), d.get("tokens_per_second_ratio")))
p = d.get("prediction", {}).get("as_run", {})
print("  predicted (not measured): checkpoint %s, planner %s: sequence x%.2f, tokens/s x%.2f" % (
    p.get("checkpoint_seq"), p.get("planner_seq"), p.get("seq_ratio") or 0, p.get("tokens_per_second_ratio") or 0))' \
      "$RESULTSEQ" 2>&1 | tail -n 6
  fi
  if [ -f "$RESULT7B" ] && [[ " $PARTS " == *" bench7b "* ]]; then
    echo "issue 18's 7B target ($RESULT7B):"
    PYTHONPATH="$ROOT/benchmarks" "$VPY" -c 'import json, sys
from gpu_offload_report import print_params_comparison, print_table
out = json.load(open(sys.argv[1])); print_table(out); print_params_comparison(out)' "$RESULT7B" 2>&1 | tail -n 20
  fi
} >>"$SUMMARY"
cat "$SUMMARY"
if ((${#failed[@]})); then
  say "failed: ${failed[*]} (logs in $OUT)"
  exit 1
fi
say "every part passed (logs in $OUT)"
