"""Saved activations on the NVMe tier: exact, write-behind, forwarding, faults, no leaked files."""

import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import tierflow
from harness import assert_bit_identical, assert_close, gpt_task, subprocess_environment, train
from children import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def swap_files(d):
    return [f for f in os.listdir(d) if f.startswith("tierflow-swap-")]


def test_activations_on_nvme_are_bit_identical(nvme_dir, device):
    task = gpt_task()
    base = train(task, 4, False, device=device)
    tier = train(task, 4, True, device=device, offload_optimizer="none", offload_activations="nvme",
                 nvme_paths=nvme_dir, nvme_memory="256MiB", min_offload_bytes=0, prefetch_bytes="256KiB")
    assert_bit_identical(base, tier)
    nv = tier.report["activations"]["nvme"]
    assert nv["writes"] > 0 and nv["reads"] > 0, nv
    assert nv["write_failures"] == 0
    assert tier.report["activations"]["kept_small"] == 0
    assert tier.report["host_pool"]["in_use"]["current"] == 0, "staging returned to the pool"
    assert tier.report["activations"]["device_bytes"]["current"] == 0, "every saved block released after backward"
    # Note [Block residences]: written behind, a block counts on NVMe and no longer on the host.
    acts = tier.report["activations"]
    assert acts["nvme_bytes"]["peak"] > 0 and acts["nvme_bytes"]["current"] == 0, acts["nvme_bytes"]
    assert acts["host_bytes"]["current"] == 0, acts["host_bytes"]
    assert "saved activations on NVMe only, peak" in str(tier.report)


def test_demo_gpt_with_activations_on_nvme_matches_the_baseline(nvme_dir, device):
    task = gpt_task(layers=4, width=128, block=128, batch=8)
    base = train(task, 3, False, device=device)
    tier = train(task, 3, True, device=device, offload_activations="nvme", nvme_paths=nvme_dir, nvme_memory="512MiB")
    assert_close(base, tier)
    assert tier.report["activations"]["nvme"]["writes"] > 0


def test_striped_over_two_paths(nvme_dir, device):
    a, b = os.path.join(nvme_dir, "a"), os.path.join(nvme_dir, "b")
    os.makedirs(a)
    os.makedirs(b)
    try:
        task = gpt_task()
        base = train(task, 2, False, device=device)
        tier = train(task, 2, True, device=device, offload_optimizer="none", offload_activations="nvme",
                     nvme_paths=[a, b],
                     nvme_memory="128MiB", min_offload_bytes=0, aio_block_size="64KiB")
        assert_bit_identical(base, tier)
    finally:
        import gc
        import tierflow._wrap as w
        w._sessions.clear()
        gc.collect()
        for d in (a, b):
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
            os.rmdir(d)


def test_last_layers_stay_on_the_device(nvme_dir, device):
    task = gpt_task()
    model, _ = tierflow.wrap(task.model_on(device), None, device=device, offload_activations="nvme",
                             nvme_paths=nvme_dir, nvme_memory="128MiB", min_offload_bytes=0, prefetch_bytes="512KiB")
    task.loss(model, task.batch_on(0, device)).backward()
    first = tierflow.report()["activations"]
    task.loss(model, task.batch_on(1, device)).backward()
    second = tierflow.report()["activations"]
    kept_first = first["packs"] - first["skipped_parameters"] - first["offloaded_blocks"] - first["dedup_hits"]
    kept_second = (second["packs"] - first["packs"]) - (second["skipped_parameters"] - first["skipped_parameters"]) \
        - (second["offloaded_blocks"] - first["offloaded_blocks"]) - (second["dedup_hits"] - first["dedup_hits"])
    assert kept_second > kept_first, "from the second step, the tail of the graph stays resident"


# Fault injection exercises tierflow's own error paths (NVMe engine, swap files,
# optimizer state), which are the same code on every device: these tests run on
# the emulated device only, forced so that they also run on a GPU machine.
def test_a_failed_write_keeps_the_data_in_host_memory(nvme_dir):
    faults = tierflow._C.NvmeFaults()
    faults.fail_writes = 3
    task = gpt_task()
    base = train(task, 2, False)
    tier = train(task, 2, True, device="emulated", offload_optimizer="none", offload_activations="nvme",
                 nvme_paths=nvme_dir, nvme_memory="128MiB", min_offload_bytes=0, _nvme_faults=faults)
    assert_bit_identical(base, tier)  # nothing lost
    assert tier.report["activations"]["nvme"]["write_failures"] >= 1


def test_a_corrupt_read_raises_and_changes_nothing(nvme_dir):
    faults = tierflow._C.NvmeFaults()
    task = gpt_task(dropout=0.0)
    model = task.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierflow.wrap(model, opt, device="emulated", offload_activations="nvme", nvme_paths=nvme_dir,
                               nvme_memory="128MiB", min_offload_bytes=0, prefetch_bytes="64KiB", _nvme_faults=faults)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = task.loss(model, task.make_batch(0))
    faults.corrupt_reads = 1000
    with pytest.raises(OSError, match="checksum mismatch"):
        loss.backward()
    opt.zero_grad()  # takes back any parameter stepped during the failed backward
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed although backward failed"
    faults.corrupt_reads = 0
    task.loss(model, task.make_batch(1)).backward()  # the next step works
    opt.step()


def test_swap_files_are_removed_at_exit_even_with_live_tensors(nvme_dir):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{os.path.join(ROOT, 'bindings', 'python')!r}, {os.path.join(ROOT, 'examples')!r},
                        {os.path.join(ROOT, 'tests', 'python')!r}]
        import tierflow
        from harness import gpt_task
        task = gpt_task()
        model, _ = tierflow.wrap(task.make_model(), None, device="emulated", offload_activations="nvme",
                                 nvme_paths={nvme_dir!r}, nvme_memory="64MiB", min_offload_bytes=0)
        keep = task.loss(model, task.make_batch(0))   # a graph still holding saved blocks at exit
        import os
        print(len([f for f in os.listdir({nvme_dir!r}) if f.startswith("tierflow-swap-")]))
    """)
    out = run_child([sys.executable, "-c", script], capture_output=True, text=True,
                    env=subprocess_environment())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1", "one swap file while running"
    assert swap_files(nvme_dir) == [], "no swap file after exit"


def test_crashed_run_files_are_removed_by_the_next_start(nvme_dir):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{os.path.join(ROOT, 'bindings', 'python')!r}]
        import tierflow
        rt = tierflow._C.Runtime({{"device": "emulated", "offload_activations": "nvme", "nvme_paths": {nvme_dir!r},
                                  "nvme_memory": "16MiB"}})
        os._exit(0)  # a crash: no destructor runs
    """)
    run_child([sys.executable, "-c", script], check=True,
              env=subprocess_environment())
    assert len(swap_files(nvme_dir)) == 1
    rt = tierflow._C.Runtime({"device": "emulated", "offload_activations": "nvme", "nvme_paths": nvme_dir,
                              "nvme_memory": "16MiB"})
    assert len(swap_files(nvme_dir)) == 1, "the dead process's file is gone; only ours remains"
    del rt


def test_nvme_needs_paths():
    with pytest.raises(tierflow.ConfigError, match="needs TIERFLOW_NVME_PATHS"):
        tierflow.wrap(torch.nn.Linear(2, 2), None, offload_activations="nvme")


def test_optimizer_states_on_nvme_match_torch_adamw(nvme_dir, device):
    task = gpt_task()
    base = train(task, 4, False, device=device)
    tier = train(task, 4, True, device=device, offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="128MiB")
    assert_close(base, tier)
    s = tier.nvme_adam
    assert s["steps"] >= 4 and s["bytes_read"] > 0 and s["bytes_written"] > 0


def test_demo_gpt_with_activations_and_optimizer_on_nvme(nvme_dir, device):
    task = gpt_task(layers=4, width=128, block=128, batch=8)
    base = train(task, 3, False, device=device)
    tier = train(task, 3, True, device=device, offload_activations="nvme", offload_optimizer="nvme",
                 nvme_paths=nvme_dir, nvme_memory="512MiB")
    assert_close(base, tier)


def test_nvme_optimizer_state_dict_round_trip_and_torch_compat(nvme_dir, device):
    task = gpt_task(dropout=0.0)
    whole = train(task, 4, True, device=device, offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="128MiB")
    torch.manual_seed(0)
    model = task.model_on(device)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                               device=device, offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="128MiB")
    for i in range(2):
        task.loss(model, task.batch_on(i, device)).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()  # states read back from NVMe: a checkpoint holds them
    first = next(iter(sd["state"].values()))
    assert first["exp_avg"].abs().sum() > 0 and float(first["step"]) == 2.0
    torch_opt = torch.optim.AdamW(task.model_on(device).parameters(), lr=1e-3, weight_decay=0.01)
    torch_opt.load_state_dict(sd)  # loads into torch.optim.AdamW
    fresh = task.model_on(device)
    fresh.load_state_dict(model.state_dict())
    fresh, opt2 = tierflow.wrap(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3, weight_decay=0.01),
                                device=device, offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="128MiB")
    opt2.load_state_dict(sd)
    for i in range(2, 4):
        task.loss(fresh, task.batch_on(i, device)).backward()
        opt2.step()
        opt2.zero_grad()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, whole.params[k]), k


def test_loading_into_an_optimizer_with_nvme_states_writes_them_in_place(nvme_dir):
    """load_state_dict over NVMe states (a resume: torch.distributed.checkpoint's set_state_dict steps a fresh
    optimizer once, making its states, then loads): each parameter's NVMe store takes the loaded state, no
    second store beside it outside the reserved space; the run goes on as the one never reloaded."""
    task = gpt_task(dropout=0.0)
    whole = train(task, 4, True, device="emulated", offload_optimizer="nvme", nvme_paths=nvme_dir,
                  nvme_memory="128MiB")
    torch.manual_seed(0)
    model = task.model_on("emulated")
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                               device="emulated", offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="128MiB")
    for i in range(2):
        task.loss(model, task.batch_on(i, "emulated")).backward()
        opt.step()
        opt.zero_grad()
    keys = {id(p): s["nvme_key"] for p, s in opt.state.items()}
    opt.load_state_dict(opt.state_dict())
    assert {id(p): s["nvme_key"] for p, s in opt.state.items()} == keys
    for i in range(2, 4):
        task.loss(model, task.batch_on(i, "emulated")).backward()
        opt.step()
        opt.zero_grad()
    for k, v in model.state_dict().items():
        assert torch.equal(v, whole.params[k]), k


def test_nvme_optimizer_write_failure_keeps_state(nvme_dir):
    faults = tierflow._C.NvmeFaults()
    task = gpt_task(dropout=0.0)
    torch.manual_seed(0)
    model = task.make_model()
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="emulated",
                               offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="128MiB",
                               _nvme_faults=faults)
    task.loss(model, task.make_batch(0)).backward()
    opt.step()
    before_params = {k: v.clone() for k, v in model.state_dict().items()}
    before_state = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()}
                    for k, s in opt.state_dict()["state"].items()}
    opt.zero_grad()
    task.loss(model, task.make_batch(1)).backward()
    faults.fail_writes = 10**6
    with pytest.raises(OSError, match="previous state and weights are kept"):
        opt.step()
    assert all(float(s["step"]) == 1.0 for s in opt.state_dict()["state"].values()), "no step counted"
    faults.fail_writes = 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_params[k]), k
    after_state = opt.state_dict()["state"]
    for k, s in before_state.items():
        for n, t in s.items():
            assert torch.equal(after_state[k][n], t), (k, n)
    opt.step()  # the retry succeeds


@pytest.mark.parametrize("optimizer", ["none", "host"])  # torch's AdamW over the host copies; tierflow's CPU AdamW
def test_a_failed_parameter_write_at_a_step_loses_nothing(nvme_dir, optimizer):
    """Note [Parameter moves]: a step whose write of a parameter to NVMe fails raises, naming it and saying its
    values are kept in host memory; the run goes on and matches the run without the fault (the CPU AdamW writes
    every stepped weight before it raises: its states have stepped)."""
    task = gpt_task(dropout=0.0)

    def run(fail_at):
        faults = tierflow._C.NvmeFaults()
        torch.manual_seed(0)
        model = task.make_model()
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="emulated",
                                   offload_params="nvme", offload_optimizer=optimizer, nvme_paths=nvme_dir,
                                   nvme_memory="128MiB", min_offload_bytes=0, _nvme_faults=faults)
        losses = []
        for i in range(3):
            loss = task.loss(model, task.make_batch(i))
            loss.backward()
            losses.append(loss.item())
            if i == fail_at:
                faults.fail_writes = 1
                with pytest.raises(OSError, match="not written to NVMe; they are kept in host memory"):
                    opt.step()
                assert faults.fail_writes == 0, "the fault was used"
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    base_losses, base_state = run(None)
    losses, state = run(0)
    assert losses == base_losses
    assert base_state.keys() == state.keys()
    for k, v in base_state.items():
        assert torch.equal(state[k], v), k


def test_no_swap_file_leaks_after_io_failures(nvme_dir):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{os.path.join(ROOT, 'bindings', 'python')!r}, {os.path.join(ROOT, 'examples')!r},
                        {os.path.join(ROOT, 'tests', 'python')!r}]
        import tierflow
        from harness import gpt_task
        faults = tierflow._C.NvmeFaults()
        faults.fail_writes = 4
        task = gpt_task()
        model = task.make_model()
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()),
                                   device="emulated", offload_activations="nvme", offload_optimizer="none",
                                   nvme_paths={nvme_dir!r}, nvme_memory="64MiB", min_offload_bytes=0,
                                   prefetch_bytes="64KiB", _nvme_faults=faults)
        loss = task.loss(model, task.make_batch(0))
        faults.corrupt_reads = 1000
        try:
            loss.backward()
        except OSError as e:
            print("raised", "checksum" in str(e))
    """)
    out = run_child([sys.executable, "-c", script], capture_output=True, text=True,
                    env=subprocess_environment())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "raised True"
    assert swap_files(nvme_dir) == [], "failed I/O leaves no swap file behind"


def test_staging_back_pressure_stays_inside_the_host_budget(nvme_dir, device):
    task = gpt_task(layers=2, width=128, block=128, batch=8)
    base = train(task, 2, False, device=device)
    # 1 MiB of pinned memory for staging, activations of 256 KiB-2 MiB each:
    # transfers must wait for writes to free staging, never exceed the budget.
    tier = train(task, 2, True, device=device, offload_optimizer="none", offload_activations="nvme",
                 nvme_paths=nvme_dir, nvme_memory="256MiB", host_memory="3MiB", pinned_slab_bytes="1MiB",
                 min_offload_bytes=0)
    assert_bit_identical(base, tier)
    assert tier.report["host_pool"]["reserved"]["peak"] <= 3 * 1024 * 1024
    acts = tier.report["activations"]
    # Every block fits the budget once the transfers ahead of it settle, so
    # none falls back to staying on the device.
    assert acts["nvme"]["staging_waits"] > 0 and acts["host_fallbacks"] == 0, acts


def test_staging_waits_for_copies_still_on_their_way_to_the_host(nvme_dir):
    # Copies to the host that take 20 ms each: when backward starts, the last
    # ones of forward still hold the staging that the first prefetches need.
    # Back-pressure must wait for them (they turn into NVMe writes, which then
    # free their staging) instead of failing for want of memory.
    # CopyFaults delays the emulated device's copies: this one is emulated only.
    faults = tierflow._C.CopyFaults()
    faults.d2h_delay_us = 20_000
    task = gpt_task(layers=2, width=128, block=128, batch=8)
    base = train(task, 2, False)
    tier = train(task, 2, True, device="emulated", offload_optimizer="none", offload_activations="nvme",
                 nvme_paths=nvme_dir, nvme_memory="256MiB", host_memory="3MiB", pinned_slab_bytes="1MiB",
                 min_offload_bytes=0, _copy_faults=faults)
    assert_bit_identical(base, tier)
    assert tier.report["host_pool"]["reserved"]["peak"] <= 3 * 1024 * 1024
    acts = tier.report["activations"]
    assert acts["nvme"]["staging_waits"] > 0 and acts["host_fallbacks"] == 0, acts
    assert acts["nvme"]["writes"] > 0 and acts["nvme"]["reads"] > 0, acts


def test_a_partial_nvme_step_failure_counts_only_what_stepped(nvme_dir):
    faults = tierflow._C.NvmeFaults()
    task = gpt_task(dropout=0.0)
    model = task.make_model()
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="emulated",
                               offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="128MiB",
                               _nvme_faults=faults)
    task.loss(model, task.make_batch(0)).backward()
    opt.step()
    opt.zero_grad()
    task.loss(model, task.make_batch(1)).backward()
    faults.fail_writes = 1
    with pytest.raises(OSError, match="1 parameter"):
        opt.step()
    steps = sorted(float(s["step"]) for s in opt.state_dict()["state"].values())
    assert steps.count(1.0) == 1 and steps.count(2.0) == len(steps) - 1, steps


def test_a_block_larger_than_the_host_budget_stays_on_the_device(nvme_dir, device):
    task = gpt_task()
    base = train(task, 2, False, device=device)
    # 64 KiB of staging cannot hold most activations: those stay on the device
    # at once (no wait could make them fit), the small ones still go to NVMe.
    tier = train(task, 2, True, device=device, offload_optimizer="none", offload_activations="nvme",
                 nvme_paths=nvme_dir, nvme_memory="64MiB", host_memory="64KiB", pinned_slab_bytes="64KiB",
                 min_offload_bytes=0)
    assert_bit_identical(base, tier)
    acts = tier.report["activations"]
    assert acts["host_fallbacks"] > 0 and acts["nvme"]["writes"] > 0, acts
    assert tier.report["host_pool"]["reserved"]["peak"] <= 64 * 1024


@pytest.mark.parametrize("release", ["unwrap", "del"])
def test_resources_go_with_the_model_and_optimizer(nvme_dir, release):
    # Note [Session lifetime]: rounds of wrap / train / (unwrap) / del hold one runtime at a time: no swap file,
    # pinned slab or session outlives the model and optimizer it served (four of each were held before).
    import gc

    from tierflow import _wrap

    gc.collect()  # what earlier tests in this process left for the collector is not this test's
    before = len(_wrap._live_sessions())
    for round_ in range(4):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        opt = torch.optim.AdamW(model.parameters())
        model, opt = tierflow.wrap(model, opt, device="emulated", offload_activations="nvme",
                                   offload_optimizer="nvme", nvme_paths=nvme_dir, nvme_memory="64MiB",
                                   min_offload_bytes=0)
        for _ in range(2):
            model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert os.listdir(nvme_dir), "the run wrote no swap file"
        session = weakref.ref(tierflow.current_session())
        if release == "unwrap":
            tierflow.unwrap(model)
            assert tierflow.current_session() is None or tierflow.current_session() is not session()
        del model, opt
        gc.collect()
        assert session() is None, f"round {round_}: the session outlived its model and optimizer"
        assert os.listdir(nvme_dir) == [], f"round {round_}: swap files left: {os.listdir(nvme_dir)}"
        assert len(_wrap._live_sessions()) == before


def test_the_planner_may_use_only_the_nvme_space_left(nvme_dir, device):
    # auto's NVMe budget is what TIERFLOW_NVME_MEMORY and the free space leave beside the optimizer's states on the
    # same tier (NvmeEngine::available_bytes); it was 2**50 bytes whatever the setting said.
    task = gpt_task()
    tier = train(task, 3, True, device=device, offload_optimizer="nvme", offload_activations="auto",
                 nvme_paths=nvme_dir, nvme_memory="32MiB")
    planner, runtime = tier.session.planner, tier.session.runtime
    assert planner.profile is not None, "the plan was made"
    left = runtime.nvme_available_bytes()
    assert planner.budgets(planner.profile)["nvme_bytes"] == left
    assert 0 < left < 32 << 20, "the optimizer's states are on the tier too"
