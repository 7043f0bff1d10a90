#!/usr/bin/env bash
# `make test-transformers5`: the tests marked `transformers` (what differs
# between transformers versions: the families' code paths, Trainer, peft,
# generate) again under transformers 5, on the polite emulated device. CI pins transformers 4.57.6 (scripts/setup.sh); a GPU
# image ships 5.x (5.17 on the H200 of 2026-11-26, where Trainer's tests
# failed: transformers 5 removed TrainingArguments(save_safetensors=) and reads
# the gradient norm at every step with clip_grad_norm_(max_norm=inf)).
#
# .venv-tf5 is a virtual environment layered over .venv (a .pth puts .venv's
# packages after its own): torch and tierflow._C are .venv's, and only
# transformers, accelerate and peft are its own, pinned below.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf '[test-transformers5] %s\n' "$*"; }

PINS=(transformers==5.17.0 accelerate==1.15.0 peft==0.21.2)
# PYTEST_OPTIONS: the Makefile's pytest options (workers, durations); PYTEST_ARGS: yours.
VPY=.venv-tf5/bin/python
[ -x .venv/bin/python ] || { echo "[test-transformers5] error: no .venv: run make setup first" >&2; exit 1; }
if [ ! -x "$VPY" ]; then
  say "creating .venv-tf5 over .venv"
  .venv/bin/python -m venv .venv-tf5
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir, not bare paths: .pth files there are processed too (a GPU image's .venv reaches its torch so)
  .venv/bin/python -c 'import site
for d in site.getsitepackages(): print(f"import site; site.addsitedir({d!r})")' >"$site/_tierflow_base_env.pth"
fi
want=$(printf '%s\n' "${PINS[@]}")
have=$("$VPY" -c 'import transformers, accelerate, peft
print(f"transformers=={transformers.__version__}\naccelerate=={accelerate.__version__}\npeft=={peft.__version__}")' 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  say "installing ${PINS[*]}"
  "$VPY" -m pip install -q "${PINS[@]}" >build/test-transformers5-pip.log 2>&1 \
    || { tail -n 20 build/test-transformers5-pip.log >&2; echo "[test-transformers5] error: pip could not install ${PINS[*]}" >&2; exit 1; }
fi
say "$("$VPY" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
# The tests marked `transformers` (Note [Test tiers] in tests/README.md): what differs between transformers
# versions (each family's code paths, Trainer, peft, generate, gradient checkpointing), once each.
mkdir -p build
TIERFLOW_EMULATED_DEVICE=polite PYTHONPATH="$ROOT/bindings/python" "$VPY" -m pytest tests/python -m transformers \
  --junitxml=build/pytest-transformers5.xml ${PYTEST_OPTIONS:--q -rs -p no:cacheprovider} ${PYTEST_ARGS:-}
