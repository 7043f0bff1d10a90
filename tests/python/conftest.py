import os
import shutil
import sys

import pytest

# MKL's sgemm rounds by the alignment of its inputs (and the threads it picks under load) unless its
# Conditional Numerical Reproducibility mode is pinned: a baseline and a run whose saved tensors came
# back from the host at other addresses then differ in the last bit (1e-9 after 3 steps of a 4-layer
# GPT-2 of width 32), which is MKL's choice, not tierflow's. The bit-for-bit comparisons need the
# reproducible mode, read when MKL first runs, so before torch is imported (the C++ trainer's exact
# run sets it too: scripts/cpp_example.sh). Children started by the tests inherit it.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
# cuBLAS is deterministic only with a fixed workspace; it reads this when its first handle is made.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from harness import DEVICES, KEPT_ENVIRONMENT  # noqa: E402  (needs the paths above)
import tierflow  # noqa: E402

# ---- Note [Test tiers] ------------------------------------------------------------------------------------------
# Where a test runs (tests/README.md has the whole rule). `make test-python` runs the suite on the polite emulated
# device, then again on the adversarial one (Note [Adversarial emulated device]) with `-m ordering`: only the
# tests whose outcome can depend on the order in which copies and NVMe requests complete. A test is `ordering`
#   - when it asks for the `device` fixture (it wraps a model on a device) or the `nvme_dir` fixture, unless it
#     says `@pytest.mark.order_free` (it asks for a device only to be refused, say) or is a [cuda] case (no
#     emulated mode reaches CUDA);
#   - when it says `@pytest.mark.ordering` (a test whose children train: gloo ranks, a fresh interpreter).
# Every other test runs once. The rule is held by what a test does, not by what it says: a test outside the
# `ordering` tier that queued a copy on the emulated device or an NVMe request in this process, in its set-up
# (module-scoped fixtures included), its call or its teardown, fails, naming the marker it needs.
TIER_MARKERS = {
    "ordering": "moves data through the copy engine or the NVMe pipeline, or steps during backward: runs on both "
                "emulated devices, polite and adversarial (Note [Test tiers] in tests/python/conftest.py)",
    "order_free": "asks for the device fixture but cannot depend on copy order (a refusal): runs once",
    "transformers": "a code path that differs between transformers versions: runs again under transformers 5 "
                    "(make test-transformers5)",
}
ORDERING_FIXTURES = ("device", "nvme_dir")


def pytest_configure(config):
    for name, doc in TIER_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    # pytest-xdist registers it; without xdist (PYTEST_WORKERS=0, an older bundle) it is known all the same.
    config.addinivalue_line("markers", "xdist_group(name): run the tests of one group in one pytest-xdist worker")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker and pytest-xdist groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("order_free") is None and any(f in item.fixturenames for f in ORDERING_FIXTURES) \
                and not _on_cuda(item):
            item.add_marker(pytest.mark.ordering)
        # A module-scoped fixture (a benchmark run, gloo ranks, an install) runs once per worker that needs it:
        # under pytest-xdist (--dist loadgroup, as the Makefile runs it) the module's tests that use one go to one
        # worker.
        defs = item._fixtureinfo.name2fixturedefs.values()
        if any(d and d[-1].scope == "module" for d in defs) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _on_cuda(item) -> bool:
    """A [cuda] case: no emulated mode reaches it, so it runs once (the counter below leaves CUDA copies out)."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("device") == "cuda"


# The count is read around the whole of a test's set-up, call and teardown, module-scoped fixtures included (a
# module fixture that trains is counted at the first test that uses it).
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_QUEUED_BEFORE] = tierflow._C._queued_transfers_in_process()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # A [cuda] case's NVMe requests count too, and no emulated mode reaches it either (on an H200, 11 [cuda] cases
    # with NVMe were failed so).
    if item.get_closest_marker("ordering") is not None or _QUEUED_BEFORE not in item.stash or _on_cuda(item):
        return
    queued = tierflow._C._queued_transfers_in_process() - item.stash[_QUEUED_BEFORE]
    if queued:
        pytest.fail(f"{item.nodeid} queued {queued} copies or NVMe requests, so its outcome can depend on their "
                    "order, but it runs on one emulated device only: ask for the `device` fixture, or mark it "
                    "@pytest.mark.ordering (Note [Test tiers] in tests/python/conftest.py)", pytrace=False)


_QUEUED_BEFORE = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def _clean_tierflow_env(monkeypatch):
    """Each test starts with no TIERFLOW_* variables (CI may set none; a developer might), except
    those the Makefile sets for the whole suite: the emulated device's mode and seed."""
    for k in list(os.environ):
        if k.startswith("TIERFLOW_") and k not in KEPT_ENVIRONMENT:
            monkeypatch.delenv(k)
    torch.manual_seed(0)
    yield


@pytest.fixture(params=DEVICES)
def device(request):
    """The device a test wraps its model for: "emulated" (CPU models, device="emulated") or "cuda"
    (models and batches on the GPU, device="cuda"; skipped, saying why, where there is none).

    On cuda, deterministic kernels: a comparison with the baseline must see tierflow's differences
    only, not those of kernels that accumulate with atomics in whatever order they run."""
    if request.param != "cuda":
        yield request.param
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield request.param
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


@pytest.fixture
def nvme_dir(request):
    """A directory for NVMe swap files on the build tree's file system (O_DIRECT works there; /tmp
    may be tmpfs, which refuses it), removed with whatever the test left in it."""
    d = os.path.join(ROOT, "build", "nvme-tests", f"{request.node.name}-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def world_of_one(monkeypatch):
    """A gloo process group of this process alone (DDP and fully_shard need one), gone after the test."""
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_runtest_logreport(report):
    """GPU_CHECK_FAILURE_LOG=path (scripts/gpu_check.sh sets it): each failure's report is appended as it
    happens, so a run stopped by a lease's time limit, or one whose worker crashed, still says what failed
    and why (pytest prints the details only at the end)."""
    path = os.environ.get("GPU_CHECK_FAILURE_LOG")
    if not path or not report.failed or getattr(report, "node", None) is not None:
        return  # (under xdist the controller sees each worker's report again, with .node: the worker wrote it)
    with open(path, "a") as f:  # one write per report: xdist's workers append to the same file
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
