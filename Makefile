# The two commands a newcomer needs (README.md):
#   make demo   installs what is missing, builds, trains the demo GPT with and without tierflow
#   make test   installs what is missing, builds, runs every test (GoogleTest + pytest)
#   make test-fast  the edit-test loop (under 5 minutes): the C++ suite and a slice of
#               the Python suite on both emulated devices (tests/README.md)
#   make cpp-example  installs the C++ package into build/dev/install, builds the
#               LibTorch trainer examples/cpp_trainer against it and runs each plan
# For a machine with no package registry: `make bundle` where there is one, then
# `make test BUNDLE=dir` (or TIERFLOW_BUNDLE=dir make test) there.
PY := .venv/bin/python
export PYTHONPATH := $(CURDIR)/bindings/python

.PHONY: setup bundle demo test test-fast test-cpp test-python test-python-fast test-transformers5 sanitize cpp-example bench gpu-check clean

# BUNDLE=dir or TIERFLOW_BUNDLE=dir (also for demo and test): install from a
# bundle, using no registry. The variable goes to the set-up only: tierflow
# refuses TIERFLOW_* variables it does not know, in the tests too.
unexport TIERFLOW_BUNDLE
setup:
	@TIERFLOW_BUNDLE="$(or $(BUNDLE),$(TIERFLOW_BUNDLE))" bash scripts/setup.sh

# Debian packages and wheels for a machine with no registry, into BUNDLE (default
# bundle/); BUNDLE_PYTHON_VERSION=3.12 for another Python (scripts/bundle.sh).
bundle:
	@bash scripts/bundle.sh "$(or $(BUNDLE),bundle)"

demo: setup
	$(PY) examples/train_gpt.py $(ARGS)

# The torch-free C++ suite under ASan+UBSan (all of it) and TSan (the threaded
# suites, tests/sanitizers/tsan.supp), in build/asan and build/tsan; CI runs it.
# SANITIZE=asan or tsan for one of the two (scripts/sanitize.sh).
sanitize: setup
	@bash scripts/sanitize.sh $(or $(SANITIZE),all)

# On a machine with a GPU (no registry needed: TIERFLOW_BUNDLE=dir): builds,
# runs the [cuda] cases and bench_gpu_offload.py --preset gpt1b in every mode,
# writes benchmarks/results/gpu_offload.json and a summary (scripts/gpu_check.sh).
gpu-check:
	@bash scripts/gpu_check.sh

# The C++ trainer against the installed package (scripts/cpp_example.sh).
cpp-example: setup
	@bash scripts/cpp_example.sh

test: setup
	@$(MAKE) --no-print-directory test-cpp test-python

test-fast: setup
	@$(MAKE) --no-print-directory test-cpp test-python-fast

test-cpp:
	@bash scripts/timed.sh "ctest (C++ suite)" sh -c 'cd build/dev && ctest --output-on-failure -j 2'

# pytest's options for every Python run: PYTEST_WORKERS processes (pytest-xdist;
# 2 where it is installed, else 0: one process), one intra-op thread each (the tests' models are tiny: two
# workers of two threads each on two cores run 2.4x slower than one), a
# module's tests that share a module-scoped fixture in one worker (conftest.py),
# the slowest tests named, and PYTEST_ARGS of yours (e.g. PYTEST_ARGS="-k zoo").
PYTEST_WORKERS ?= $(shell $(PY) -c 'import xdist' 2>/dev/null && echo 2 || echo 0)
PYTEST_OPTIONS = -q -rs -p no:cacheprovider --durations=15 \
	$(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadgroup)
export PYTEST_OPTIONS
PYTEST = OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_OPTIONS) $(PYTEST_ARGS)

# Note [Test tiers] (tests/README.md): every test on the polite emulated device,
# then the tests whose outcome can depend on copy order (-m ordering) on the
# adversarial one (Note [Adversarial emulated device]). Every test's time is in
# build/pytest-*.xml. On a machine with a GPU the [cuda] cases run too.
test-python:
	@mkdir -p build
	@bash scripts/timed.sh "pytest, polite (every test)" env TIERFLOW_EMULATED_DEVICE=polite \
	  $(PYTEST) tests/python --junitxml=build/pytest-polite.xml
	@bash scripts/timed.sh "pytest, adversarial (-m ordering)" env TIERFLOW_EMULATED_DEVICE=adversarial \
	  $(PYTEST) tests/python -m ordering --junitxml=build/pytest-adversarial.xml

# The edit-test loop's slice: one file of each kind the suite has (the API and
# its refusals, activations, streaming and the CPU optimizer, parameters, NVMe,
# the planner, transformers' families), on both emulated devices.
FAST_TESTS ?= tests/python/test_api.py tests/python/test_equivalence.py tests/python/test_streaming.py \
	tests/python/test_plans.py tests/python/test_nvme.py tests/python/test_hf_models.py tests/python/test_readme.py
test-python-fast:
	@bash scripts/timed.sh "pytest, polite (fast slice)" env TIERFLOW_EMULATED_DEVICE=polite \
	  $(PYTEST) $(FAST_TESTS)
	@bash scripts/timed.sh "pytest, adversarial (fast slice, -m ordering)" env TIERFLOW_EMULATED_DEVICE=adversarial \
	  $(PYTEST) $(FAST_TESTS) -m ordering

# The tests marked `transformers` again under transformers 5 (CI pins 4.57.6; GPU images ship 5.x),
# in .venv-tf5 over .venv (scripts/test_transformers5.sh).
test-transformers5: setup
	@bash scripts/timed.sh "pytest, transformers 5 (-m transformers)" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
	  bash scripts/test_transformers5.sh

# The training-loop fuzzer's long run (tests/python/loop_fuzz.py, issue 37): SEEDS loops from START in JOBS
# processes on the emulated device (TIERFLOW_EMULATED_DEVICE=adversarial for the other mode); a JSON summary of
# the findings by cause on stdout and in build/fuzz-loops/summary.json (scripts/fuzz_loops.py). Builds nothing.
.PHONY: fuzz-loops
fuzz-loops:
	$(PY) scripts/fuzz_loops.py --seeds $(or $(SEEDS),1000) --start $(or $(START),0) $(if $(JOBS),--jobs $(JOBS))

# Benchmarks compare against peers measured in the same run; DeepSpeed (its CPU
# Adam op compiles on first use, about a minute) is installed into .venv here;
# bitsandbytes and torchao (the 8-bit AdamW peers) into build/bench-peers, which
# only the benchmark imports from: in .venv, torchao breaks peft's LoRA import.
bench: setup
	@$(PY) -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(PY) -m pip install -q deepspeed || echo "deepspeed could not be installed: the benchmark reports why"
	@[ -d build/bench-peers/torchao ] || $(PY) -m pip install -q --no-deps --target build/bench-peers bitsandbytes torchao || echo "bitsandbytes or torchao could not be installed: the benchmark reports why"
	mkdir -p benchmarks/results
	build/dev/benchmarks/bench_host_tier --json benchmarks/results/host_tier.json
	OMP_NUM_THREADS=2 $(PY) benchmarks/bench_optimizer.py --threads 2
	@command -v fio >/dev/null || (apt-get install -y -qq fio >/dev/null 2>&1 || sudo apt-get install -y -qq fio) || echo "fio could not be installed"
	$(PY) benchmarks/bench_nvme.py
	$(PY) benchmarks/bench_fsdp_optimizer.py
	$(PY) benchmarks/bench_ddp_optimizer.py

# Issue 39's accuracy study, not part of bench: a transformers GPT-2 trained 300 steps with fp32, bf16 and 8-bit
# AdamW moments (TIERFLOW_OPTIMIZER_STATES), three seeds each, one after another on the emulated device (about
# 6 minutes on 2 cores); writes benchmarks/results/finetune_states.json and docs/finetune_states.png
# (docs/benchmarks.md). ARGS for the script's options (e.g. ARGS="--seeds 5").
.PHONY: finetune-states
finetune-states: setup
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) benchmarks/finetune_states.py $(ARGS)

clean:
	rm -rf build bindings/python/tierflow/_C*.so bindings/python/tierflow/_core*.so
