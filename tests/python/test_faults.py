"""Faults of the NVMe and host tiers (issue 16): every one is a clear error, and nothing is lost.

A full disk, a failed write or a corrupt state fails only the parameters it
touches; a retry steps each parameter exactly once, so the weights are those of
a run that never failed (Note [NVMe optimizer faults] in tierflow/_nvme_states.py).
Real ENOSPC, read-only and ramfs cases mount a small file system and need root
and loop devices; without them they skip saying so, and the injected faults
(tierflow._C.NvmeFaults) cover the same code.
"""

import copy
import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from torch import nn

import tierflow
from tierflow.optim import LOST_STATE
from children import run_child, wait_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mount(kind: str, size_mib: int = 16):
    """Mounts a small file system (kind: 'ext4' on a loop device, or 'ramfs'); (mount point, cleanup) or a
    pytest.skip naming what is missing."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {kind} file system")
    base = tempfile.mkdtemp(dir=os.path.join(ROOT, "build"))
    mnt = os.path.join(base, "mnt")
    os.makedirs(mnt)
    if kind == "ext4":
        img = os.path.join(base, "fs.img")
        cmd = (f"truncate -s {size_mib}M {img} && mkfs.ext4 -q -F {img} >/dev/null 2>&1 && "
               f"mount -o loop {img} {mnt}")
    else:
        cmd = f"mount -t ramfs none {mnt}"
    if run_child(cmd, shell=True, capture_output=True).returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"cannot mount a {kind} file system here ({cmd.split(' && ')[-1]} failed: no loop device?)")

    def cleanup():
        # Sessions still alive (a traceback may hold one) on this mount let go of their files now.
        import gc

        from tierflow import _wrap
        gc.collect()
        for s in [s for s in _wrap._live_sessions() if mnt in s.config.get("TIERFLOW_NVME_PATHS", "")]:
            s.detach()
            s.runtime.unlink_nvme_files()
        gc.collect()
        if run_child(["umount", mnt], capture_output=True).returncode != 0:
            run_child(["umount", "-l", mnt], capture_output=True)  # detached now, gone with its last file
        shutil.rmtree(base, ignore_errors=True)
    return mnt, cleanup


@pytest.fixture
def small_disk():
    mnt, cleanup = _mount("ext4", 16)
    yield mnt
    cleanup()


def fill(path: str, leave: int = 0) -> str:
    """A ballast file that leaves `leave` bytes free on path's file system."""
    ballast = os.path.join(path, "ballast")
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    fd = os.open(ballast, os.O_CREAT | os.O_RDWR, 0o600)
    size, offset = max(free - leave, 4096), 0
    try:
        while size >= 4096:  # as much as the file system gives, down to its last blocks
            try:
                os.posix_fallocate(fd, offset, size)
                offset += size
            except OSError:
                size //= 2
    finally:
        os.close(fd)
    return ballast


def swap_files(d):
    return [f for f in os.listdir(d) if f.startswith("tierflow-swap-")]


# ---- a small model whose every step is known ----------------------------------------------------------------------

def make_model(extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    if extra:  # a second group, added after wrap: 786 KB of states
        m.append(nn.Linear(8, 4096))
        m.append(nn.Linear(4096, 8))
    return m


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    return ((model(x) - y) ** 2).mean()


def wrapped(nvme_dir: str, model=None, faults=None, groups=None, **settings):
    model = model or make_model()
    params = groups(model) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    settings.setdefault("nvme_memory", "64MiB")
    return tierflow.wrap(model, opt, device="emulated", offload_optimizer="nvme", nvme_paths=nvme_dir,
                         _nvme_faults=faults, **settings)


def baseline(steps: int, extra: bool = False) -> dict:
    """torch.optim.AdamW, never failing: the parameters after each step."""
    model = make_model(extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for i in range(steps):
        loss_of(model, i).backward()
        opt.step()
        opt.zero_grad()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def nvme_baseline(nvme_dir: str, steps: int, **kw) -> tuple:
    """tierflow with states on NVMe, never failing: (parameters, optimizer state dict) after each step."""
    model, opt = wrapped(nvme_dir, **kw)
    params, states = [], []
    for i in range(steps):
        loss_of(model, i).backward()
        opt.step()
        opt.zero_grad()
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        states.append(copy.deepcopy(opt.state_dict()))
    tierflow.unwrap(model)
    return params, states


def assert_same(params: dict, model: nn.Module, what: str) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), f"{k}: {what}"


def assert_close_to_torch(params: dict, model: nn.Module) -> None:
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, params[k], rtol=1e-5, atol=5e-6, msg=lambda m, k=k: f"{k} vs torch.optim.AdamW: {m}")


def steps_of(opt) -> list:
    return sorted(float(s["step"]) for s in opt.state_dict()["state"].values())


# ---- item 3: a failed or partial NVMe step is retried -------------------------------------------------------------

def test_a_failed_first_step_leaves_no_half_made_state_and_a_retry_steps_everything_once(nvme_dir):
    never_failed, _ = nvme_baseline(nvme_dir, 3)
    torch_params = baseline(3)
    faults = tierflow._C.NvmeFaults()
    model, opt = wrapped(nvme_dir, faults=faults)
    loss_of(model, 0).backward()
    faults.fail_writes = 1  # the first parameter's state cannot be written when it is made
    with pytest.raises(OSError, match=r"'0\.weight' \[64, 32\]"):
        opt.step()
    assert steps_of(opt) == [1.0] * 5, "the others stepped once; the failed one has no state yet"
    opt.step()  # the retry: no KeyError, and nobody steps twice
    assert steps_of(opt) == [1.0] * 6
    assert_same(never_failed[0], model, "after the retry, as a run that never failed")
    opt.zero_grad()
    for i in (1, 2):
        loss_of(model, i).backward()
        opt.step()
        opt.zero_grad()
    assert steps_of(opt) == [3.0] * 6
    assert_same(never_failed[2], model, "two steps later, still the same")
    assert_close_to_torch(torch_params[2], model)


def test_a_partial_step_retried_steps_every_parameter_exactly_once(nvme_dir):
    never_failed, _ = nvme_baseline(nvme_dir, 2)
    faults = tierflow._C.NvmeFaults()
    model, opt = wrapped(nvme_dir, faults=faults)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    loss_of(model, 1).backward()
    faults.fail_writes = 2
    with pytest.raises(OSError, match="previous state and weights are kept"):
        opt.step()
    assert steps_of(opt) == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    opt.step()  # was [2, 3] before issue 16: the stepped ones stepped again
    assert steps_of(opt) == [2.0] * 6
    assert_same(never_failed[1], model, "a retried partial step is the step")
    opt.step()  # a second step() with the same gradients is a step, as torch's is
    assert steps_of(opt) == [3.0] * 6


@pytest.mark.parametrize("how", ["real", "injected"])
def test_a_full_disk_mid_step_then_space_freed_steps_every_parameter_once(nvme_dir, how, request):
    """The last layer joins with add_param_group after wrap: its space is reserved at its first step, on
    a disk that another process filled in between."""
    if how == "real":
        mnt, cleanup = _mount("ext4", 16)
        request.addfinalizer(cleanup)
        where = os.path.join(mnt, "swap")
        os.makedirs(where)
    else:
        where = nvme_dir
    groups = lambda m: [{"params": list(m[:5].parameters())}]  # noqa: E731
    torch_params = baseline(2, extra=True)
    model, opt = wrapped(nvme_dir, model=make_model(extra=True), groups=groups)  # never fails
    opt.add_param_group({"params": list(model[5:].parameters())})
    for i in range(2):
        loss_of(model, i).backward()
        opt.step()
        opt.zero_grad()
    never_failed = {k: v.clone() for k, v in model.state_dict().items()}
    tierflow.unwrap(model)
    model = make_model(extra=True)
    faults = tierflow._C.NvmeFaults()
    model, opt = wrapped(where, model=model, faults=faults, groups=groups, nvme_memory="auto")
    opt.add_param_group({"params": list(model[5:].parameters())})
    loss_of(model, 0).backward()
    if how == "real":
        ballast = fill(mnt, leave=0)
    else:
        faults.fail_grows = 1000
    with pytest.raises(OSError, match=r"'5\.weight' \[4096, 8\].*'6\.bias' \[8\]") as err:
        opt.step()
    assert "No space left" in str(err.value) and "free" in str(err.value), str(err.value)
    assert steps_of(opt) == [1.0] * 6, "the first group stepped"
    if how == "real":
        os.unlink(ballast)
    else:
        faults.fail_grows = 0
    opt.step()
    assert steps_of(opt) == [1.0] * 10
    opt.zero_grad()
    loss_of(model, 1).backward()
    opt.step()
    assert steps_of(opt) == [2.0] * 10
    assert_same(never_failed, model, "as a run that never failed")
    assert_close_to_torch(torch_params[1], model)
    del opt, model
    import gc
    gc.collect()


# ---- item 7: the NVMe budget is what the run needs --------------------------------------------------------------------

def test_the_default_budget_takes_what_the_states_need_not_the_disk(nvme_dir):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = tierflow.wrap(model, opt, device="emulated", offload_optimizer="nvme", nvme_paths=nvme_dir)
    assert tierflow.report()["config"]["TIERFLOW_NVME_MEMORY"] == "auto"
    (f,) = swap_files(nvme_dir)
    states = sum(p.numel() for p in model.parameters()) * 12
    size = os.path.getsize(os.path.join(nvme_dir, f))
    assert states <= size <= states + (64 << 20), f"reserved {size} bytes for {states} bytes of states"
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    assert os.path.getsize(os.path.join(nvme_dir, f)) == size, "the step needed nothing beyond the reservation"


def test_states_larger_than_the_disk_are_an_error_at_wrap_and_leave_nothing(small_disk):
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 25 MB of states, 16 MiB disk
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OSError) as err:
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", offload_optimizer="nvme",
                      nvme_paths=small_disk)
    msg = str(err.value)
    for part in ("states of 4 parameter(s) need 24.02 MiB", "free on " + small_disk, "TIERFLOW_NVME_MEMORY",
                 "No space left"):
        assert part in msg, msg
    assert swap_files(small_disk) == [], "no swap file left behind"
    assert_same(before, model, "wrap changed nothing")
    assert getattr(model, "_tierflow_session", None) is None


@pytest.mark.ordering
def test_a_checkpoint_still_fits_beside_the_swap_files(small_disk):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated",
                               offload_optimizer="nvme", offload_activations="nvme", nvme_paths=small_disk,
                               min_offload_bytes=0)
    for _ in range(2):
        model(torch.randn(64, 256)).sum().backward()
        opt.step()
        opt.zero_grad()
    path = os.path.join(small_disk, "ckpt.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)  # failed with 90% preallocated
    loaded = torch.load(path)
    assert torch.equal(loaded["model"]["0.weight"], model.state_dict()["0.weight"])


# ---- what holds: clear errors at wrap, and nothing lost ---------------------------------------------------------------

def _wrap_error(path: str, **kw) -> str:
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((OSError, ValueError, MemoryError)) as err:
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", offload_optimizer="nvme",
                      nvme_paths=path, **kw)
    assert_same(before, model, "a failed wrap changes nothing")
    if os.path.isdir(path):
        assert swap_files(path) == [], "a failed wrap leaves no swap file"
    return str(err.value)


def test_a_missing_path_is_an_error_at_wrap(nvme_dir):
    msg = _wrap_error(os.path.join(nvme_dir, "no-such-dir"))
    assert "TIERFLOW_NVME_PATHS" in msg and "no-such-dir" in msg, msg


def test_a_file_as_path_is_an_error_at_wrap(nvme_dir):
    f = os.path.join(nvme_dir, "a-file")
    open(f, "w").close()
    msg = _wrap_error(f)
    assert "a-file" in msg and "Not a directory" in msg, msg


def test_a_full_disk_is_an_error_at_wrap(small_disk):
    fill(small_disk)
    msg = _wrap_error(small_disk)
    assert small_disk in msg and ("No space left" in msg or "free" in msg), msg


def test_a_read_only_file_system_is_an_error_at_wrap(small_disk):
    if run_child(["mount", "-o", "remount,ro", small_disk], capture_output=True).returncode != 0:
        pytest.skip("cannot remount the test file system read-only")
    try:
        msg = _wrap_error(small_disk)
        assert small_disk in msg and "Read-only" in msg, msg
    finally:
        run_child(["mount", "-o", "remount,rw", small_disk], capture_output=True)


def test_a_file_system_without_o_direct_is_an_error_at_wrap():
    mnt, cleanup = _mount("ramfs")
    try:
        msg = _wrap_error(mnt)
        assert mnt in msg and "O_DIRECT" in msg, msg
    finally:
        cleanup()


# ---- item 8: a corrupt state is lost alone, and the rest is saved -------------------------------------------------------

def test_a_corrupt_state_names_its_parameter_and_everything_intact_is_saved(nvme_dir):
    never_failed, never_failed_states = nvme_baseline(nvme_dir, 2)
    model, opt = wrapped(nvme_dir)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    good = copy.deepcopy(opt.state_dict())  # the last good checkpoint
    loss_of(model, 1).backward()
    # Bytes of '2.weight's state on disk are overwritten.
    p = model[2].weight
    (file, offset, nbytes), = tierflow.current_session().runtime.nvme_adam_extents(opt.state[p]["nvme_key"])
    with open(file, "r+b") as f:
        f.seek(offset + 1000)
        f.write(b"\xde\xad\xbe\xef" * 8)
    with pytest.raises(OSError) as err:
        opt.step()
    msg = str(err.value)
    for part in ("'2.weight' [64, 64]", "is lost", "checksum mismatch", "the data on disk is corrupt", LOST_STATE):
        assert part in msg, msg
    sd = opt.state_dict()  # still works: every intact state is saved
    index = {id(q): i for i, q in enumerate(model.parameters())}
    lost = index[id(p)]
    assert LOST_STATE in sd["state"][lost] and float(sd["state"][lost]["step"]) == 1.0
    assert "exp_avg" not in sd["state"][lost]
    for k, s in sd["state"].items():
        if k != lost:
            want = never_failed_states[1]["state"][k]
            assert float(s["step"]) == 2.0
            for n in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(s[n], want[n]), (k, n)
    # torch.optim.AdamW is told nothing silently: ours refuses the marked state dict, naming the parameter.
    with pytest.raises(tierflow.TierflowError, match=r"'2\.weight'.*fill_lost_states"):
        opt.load_state_dict(sd)
    # Recovery: the lost state from the last good checkpoint, the rest from what survived.
    opt.load_state_dict(tierflow.CPUAdamW.fill_lost_states(sd, good))
    opt.step()  # the same gradients: only the parameter that did not step steps
    assert steps_of(opt) == [2.0] * 6
    assert_same(never_failed[1], model, "recovered to the run that never failed")


# ---- item 9: the host budget is checked at wrap ---------------------------------------------------------------------------

@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_host_budget_too_small_for_the_optimizer_is_an_error_at_wrap(nvme_dir, tier):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kw = dict(nvme_paths=nvme_dir, nvme_memory="64MiB") if tier == "nvme" else {}
    with pytest.raises(MemoryError) as err:
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", offload_optimizer=tier,
                      host_memory="128KiB", pinned_slab_bytes="64KiB", **kw)
    msg = str(err.value)
    # 131584 x 12 B of states (NVMe: two of 65536 x 12 B at a time) and one step's gradient copies and new
    # weights on the host (131584 x 8 B): Note [Atomic step]
    need = "2.52 MiB"
    for part in (f"needs {need}", "budget of 128.00 KiB", "TIERFLOW_HOST_MEMORY=131072"):
        assert part in msg, msg
    assert_same(before, model, "wrap changed nothing")
    assert swap_files(nvme_dir) == []


# ---- item 6: stale swap files are judged by a lock, not by the pid in their name ---------------------------------------

def test_a_live_trainers_swap_file_is_kept_and_a_killed_ones_is_removed(nvme_dir):
    import signal
    import sys

    from harness import subprocess_environment

    script = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'bindings', 'python')!r})\n"
              "import tierflow\n"
              f"rt = tierflow._C.Runtime({{'device': 'emulated', 'offload_optimizer': 'nvme', "
              f"'nvme_paths': {nvme_dir!r}}})\n"
              "print('ready', flush=True)\n"
              "sys.stdin.read()\n")
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=subprocess_environment())
    try:
        assert other.stdout.readline().strip() == "ready"
        (theirs,) = swap_files(nvme_dir)
        settings = {"device": "emulated", "offload_optimizer": "nvme", "nvme_paths": nvme_dir}
        rt = tierflow._C.Runtime(settings)  # its start judges the other trainer's file
        assert theirs in swap_files(nvme_dir), "a running trainer's file is never removed"
        assert len(swap_files(nvme_dir)) == 2
        del rt
        other.send_signal(signal.SIGKILL)
        wait_child(other, "the trainer killed with SIGKILL")
        assert swap_files(nvme_dir) == [theirs], "kill -9 leaves the file behind"
        rt = tierflow._C.Runtime(settings)
        assert theirs not in swap_files(nvme_dir) and len(swap_files(nvme_dir)) == 1, "removed at the next start"
        del rt
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
