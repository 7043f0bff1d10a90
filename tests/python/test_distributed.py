"""tierflow under torch.distributed (Note [Distributed training] in bindings/python/tierflow/_distributed.py).

DDP: two gloo processes train a small MLP with DDP, with and without tierflow, in both orders
(tierflow.wrap(DDP(model)) and DDP(tierflow.wrap(model))), activations kept or swapped to the host,
the user's optimizer or tierflow's CPU optimizer. The results must be DDP's own (bit-identical with
offload_optimizer='none', within the CPU optimizer's rounding with 'host'), and the CPU optimizer steps
each parameter during backward from its reduced gradient (fed by tierflow's DDP communication hook), every
such step committed and bit-identical to the step step() takes with TIERFLOW_OVERLAP_STEP=off; so also with
gradient_as_bucket_view, no_sync, static_graph, find_unused_parameters, tierflow's clip (redone only where it
binds) and a user's comm hook registered after wrap. A hook registered before tierflow sees DDP turns those
steps off with a warning; TIERFLOW_OFFLOAD_GRADIENTS=on is refused under DDP.

FSDP2 (torch.distributed.fsdp.fully_shard): two gloo processes train a small transformer-like model whose blocks
and root are FSDP2 units, with and without tierflow, in both orders (wrap after fully_shard, fully_shard after
wrap), activations kept, swapped to the host, recomputed, and planned (auto, with room and under a tight budget),
the user's optimizer stepping FSDP2's shards (bit-identical to FSDP2 alone on each rank) or tierflow's CPU AdamW
stepping each rank's shard (within its rounding; each rank holds its shard's states only); transformers' GPT-2
with its default config alike; checkpoints through torch.distributed.checkpoint resume bit for bit. What FSDP2's
shards do not take yet (NVMe optimizer states, offloaded gradients, the GPU share, parameter offload, a CPU
optimizer over a partly sharded model or made before fully_shard) is refused with an error that names it and
says what FSDP2 accepts (a process group of one process; fully_shard runs on the CPU with gloo).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import tierflow
from harness import Run, assert_bit_identical, assert_close, subprocess_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

STEPS = 3
SETTINGS = [(acts, opt) for acts in ("none", "host") for opt in ("none", "host")]
ORDERS = ("wrap(DDP)", "DDP(wrap)")
# The DDP settings run in both orders (the others, once tierflow's hook is registered, feed the same way: wrap(DDP)
# only). tierflow sees DDP(wrap) at the first forward: a hook registered before that is the "hook before" case.
BOTH_ORDERS = ("bucket view", "no_sync", "static graph", "clip binds", "hook before")
# ... and those also run with TIERFLOW_OVERLAP_STEP=off, to compare the steps during backward with, bit for bit.
EXACT = ("bucket view", "small buckets", "no_sync", "hook after")

# One script, run by each of the two ranks: every DDP case in one process group (starting the
# processes costs more than all the training). Each rank saves what it saw; the tests compare.
_WORKER = textwrap.dedent("""
    import contextlib, datetime, sys, warnings
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.algorithms.join import Join
    sys.path[:0] = [{bindings!r}]
    import tierflow
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a rank that failed ends the other's wait
    torch.set_num_threads(1)
    STEPS = {steps}

    def batch(step):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)

    class WithSpare(nn.Module):  # a parameter the forward never uses (find_unused_parameters=True)
        def __init__(self, body):
            super().__init__()
            self.body, self.spare = body, nn.Linear(4, 4)

        def forward(self, x):
            return self.body(x)

    def halved(state, bucket):  # a user's hook that returns a new tensor: DDP's average, halved
        return allreduce_hook(state, bucket).then(lambda fut: fut.value() * 0.5)

    def run(parallel, order, ddp=None, clip=None, no_sync=False, hook=None, join=False, **settings):
        # ddp: DDP's keyword arguments; clip: clip_grad_norm_'s max_norm (tierflow's max_grad_norm when
        # wrapped); no_sync: each step a first micro-batch under DDP's no_sync; hook: (when, hook) registered
        # on the DDP module "before" tierflow sees it or "after" tierflow.wrap(DDP(model)); join: uneven inputs
        # (rank 1 has one step less) under DDP's join().
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        if (ddp or {{}}).get("find_unused_parameters"):
            model = WithSpare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        settings = dict(settings, device="emulated", min_offload_bytes=0, cpu_threads=1) if order else settings
        if clip is not None and order:
            settings["max_grad_norm"] = clip
        when, user_hook = hook or (None, None)
        result = dict(losses=[], overlap=[], warnings=[], error=None, offloaded_bytes=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if order == "wrap(DDP)":
                    net = DDP(model, **(ddp or {{}}))
                    if when == "before":
                        net.register_comm_hook(None, user_hook)
                    net, opt = tierflow.wrap(net, opt, **settings)
                    if when == "after" and user_hook == "builtin":
                        net._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
                    elif when == "after":
                        net.register_comm_hook(None, user_hook)
                elif order == "DDP(wrap)":
                    model, opt = tierflow.wrap(model, opt, **settings)
                    net = DDP(model, **(ddp or {{}}))
                    if when == "before":  # before the first forward, where tierflow sees the DDP
                        net.register_comm_hook(None, user_hook)
                elif order == "wrap":
                    net, opt = tierflow.wrap(model, opt, **settings)
                elif parallel == "ddp":
                    net = DDP(model, **(ddp or {{}}))
                    if user_hook is not None:
                        net.register_comm_hook(None, user_hook)
                else:
                    net = model
                with Join([net]) if join else contextlib.nullcontext():  # the ranks' steps may differ
                    for step in range(STEPS - 1 if join and rank == 1 else STEPS):  # rank 1 runs out first
                        x, y = batch(step)
                        if no_sync:
                            with net.no_sync():
                                nn.functional.mse_loss(net(x[:16]), y[:16]).backward()
                            x, y = x[16:], y[16:]
                        loss = nn.functional.mse_loss(net(x), y)
                        loss.backward()
                        if parallel == "by hand":  # what DDP does, written out: average the gradients
                            for p in model.parameters():
                                dist.all_reduce(p.grad)
                                p.grad.div_(2)
                        if clip is not None and not order:
                            result.setdefault("norms", []).append(
                                float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
                        opt.step()
                        opt.zero_grad()
                        result["losses"].append(loss.item())
                        if isinstance(opt, tierflow.CPUAdamW):
                            result["overlap"].append(dict(opt.overlap_stats))
                if isinstance(opt, tierflow.CPUAdamW):
                    result["after_join"] = dict(opt.overlap_stats)  # what join's shadow passes streamed: nothing
            except tierflow.TierflowError as e:
                result["error"] = str(e)
        result["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("tierflow")]
        result["params"] = {{k: v.detach().clone() for k, v in model.state_dict().items()}}
        if order and result["error"] is None:
            result["offloaded_bytes"] = tierflow.report()["activations"]["offloaded_bytes"]
            tierflow.unwrap(model if order != "wrap(DDP)" else net)
        return result

    CASES = {{"bucket view": dict(ddp=dict(gradient_as_bucket_view=True)),
             "small buckets": dict(ddp=dict(bucket_cap_mb=0.002)),  # several DDP buckets from the second step
             "clip binds": dict(clip=0.25, grad_bucket_bytes="4KiB"),  # bucket by bucket: some steps before the stop
             "no_sync": dict(no_sync=True),
             "no_sync told": dict(no_sync=True, grad_accumulation_steps=2),
             "static graph": dict(ddp=dict(static_graph=True)),
             "unused found": dict(ddp=dict(find_unused_parameters=True)),
             "hook before": dict(hook=("before", halved)), "hook after": dict(hook=("after", halved)),
             "builtin hook after": dict(hook=("after", "builtin")), "join": dict(join=True)}}
    results = {{("ddp", None): run("ddp", None), ("by hand", None): run("by hand", None),
               ("by hand", "wrap"): run("by hand", "wrap", offload_activations="none", offload_optimizer="host")}}
    for order in {orders!r}:
        for acts, opt in {settings!r}:
            results[(order, acts, opt)] = run("ddp", order, offload_activations=acts, offload_optimizer=opt)
        results[(order, "overlap off")] = run("ddp", order, offload_activations="none", offload_optimizer="host",
                                              overlap_step="off")
        results[(order, "offload gradients")] = run("ddp", order, offload_activations="none",
                                                    offload_optimizer="host", offload_gradients="on")
    for name, case in CASES.items():
        if name != "builtin hook after":
            results[("ddp", name)] = run("ddp", None, **case)
        for order in {orders!r}:
            if order == "DDP(wrap)" and name not in {both_orders!r}:
                continue  # the same feeding once registered: the order's own cases only
            results[(order, name)] = run("ddp", order, offload_activations="none", offload_optimizer="host", **case)
        # What the CPU AdamW computes stepping in step() only, to compare the steps during backward with.
        if name in {exact!r}:
            results[("wrap(DDP)", name, "overlap off")] = run("ddp", "wrap(DDP)", offload_activations="none",
                                                              offload_optimizer="host", overlap_step="off", **case)
    torch.save(results, out_path)
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> list:
    """Per rank, {case: what that rank saw}; both ranks run every case of the worker script."""
    d = tmp_path_factory.mktemp("ddp")
    script = _WORKER.format(bindings=os.path.join(ROOT, "bindings", "python"), steps=STEPS, orders=ORDERS,
                            settings=SETTINGS, both_orders=BOTH_ORDERS, exact=EXACT)
    return _run_ranks(d, script)


def _run_ranks(d, script: str, ranks: int = 2) -> list:
    """Runs ``script`` as ``ranks`` processes (argv: rank, store file, output file); each one's torch.load-ed output."""
    env = subprocess_environment()
    env.pop("LOCAL_WORLD_SIZE", None)  # the group is the machine's ranks (Note [Ranks on one machine])
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on loopback, whatever the host name resolves to
    procs, logs = [], []
    for rank in range(ranks):
        log = open(d / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(rank), str(d / "store"),
                                       str(d / f"rank{rank}.pt")], stdout=log, stderr=subprocess.STDOUT,
                                      env=env))
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read()
        log.close()
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text[-4000:]}"
        outputs.append(torch.load(d / f"rank{rank}.pt", weights_only=False))
    return outputs


# Note [Ranks on one machine]: two ranks on one machine with activations on one NVMe path.
_RANKS_WORKER = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist, torch.nn as nn
    sys.path[:0] = [{bindings!r}]
    import tierflow

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    nvme = os.path.join(os.path.dirname(store), "nvme")
    os.makedirs(nvme, exist_ok=True)
    settings = dict(device="emulated", offload_activations="nvme", nvme_paths=nvme, nvme_memory="50%",
                    host_memory="40%", offload_optimizer="none", min_offload_bytes=0)
    alone = tierflow._C.Runtime(tierflow._config.settings_to_strings(settings))  # before the group: one process
    alone_budgets = (alone.host_budget_bytes(), alone.nvme_available_bytes())
    del alone
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model, _ = tierflow.wrap(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)), None, **settings)
    loss = model(torch.randn(8, 16)).sum()
    rt = tierflow.current_session().runtime
    # The write-behind to NVMe is asynchronous: a backward that came before it
    # would take the blocks back from staging and write nothing. Settle the
    # copies (which starts the writes) and wait for one to land, not for time.
    deadline = time.monotonic() + 60
    while tierflow.report()["activations"]["nvme"]["writes"] == 0 and time.monotonic() < deadline:
        rt.synchronize()
        time.sleep(0.01)
    loss.backward()
    files = sorted(f for f in os.listdir(nvme) if f.startswith("tierflow-swap-"))
    dist.barrier()  # both ranks' files exist now
    files_now = sorted(f for f in os.listdir(nvme) if f.startswith("tierflow-swap-"))
    torch.save(dict(alone=alone_budgets, mine=(rt.host_budget_bytes(), rt.nvme_available_bytes()),
                    files=files_now, pid=os.getpid(),
                    nvme_writes=tierflow.report()["activations"]["nvme"]["writes"]), out_path)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_ranks_on_one_machine_share_its_ram_and_nvme_and_name_their_swap_files(tmp_path):
    """Two ranks: a percentage budget is halved per rank, each rank's swap file carries its rank, both write."""
    script = _RANKS_WORKER.format(bindings=os.path.join(ROOT, "bindings", "python"))
    outs = _run_ranks(tmp_path, script)
    for rank, out in enumerate(outs):
        (host_alone, nvme_alone), (host, nvme) = out["alone"], out["mine"]
        assert abs(host - host_alone / 2) <= 1, (rank, host, host_alone)
        assert abs(nvme - nvme_alone / 2) <= 0.02 * nvme_alone, (rank, nvme, nvme_alone)  # the free space moves
        assert out["nvme_writes"] > 0
        assert any(f.startswith(f"tierflow-swap-rank{rank}-{out['pid']}-") for f in out["files"]), out["files"]
    assert outs[0]["files"] == outs[1]["files"] and len(outs[0]["files"]) == 2, outs[0]["files"]


def _as_run(result: dict) -> Run:
    return Run(losses=result["losses"], params=result["params"])


PARAMS = 6  # the MLP's weights and biases, each stepped once per step


def _per_step(counts: list) -> list:
    """overlap_stats after each step -> what each step added."""
    keys = ("early_steps", "committed", "redone")
    before = dict.fromkeys(keys, 0)
    out = []
    for c in counts:
        out.append({k: c[k] - before[k] for k in keys})
        before = c
    return out


def _assert_all_committed(counts: list, where: str, unused: int = 0) -> None:
    """Every parameter stepped during backward, from the reduced gradient, and committed: nothing redone. An
    unused parameter (find_unused_parameters) streams DDP's zeros, and its step is taken back (p.grad stays None)."""
    for i, c in enumerate(_per_step(counts)):
        assert c == dict(early_steps=PARAMS + unused, committed=PARAMS, redone=0), f"{where}, step {i}: {c}"


@pytest.mark.parametrize("acts", ["none", "host"])
@pytest.mark.parametrize("order", ORDERS)
def test_ddp_trains_as_without_tierflow_and_steps_once(ddp_runs, order, acts):
    """DDP's results, with the user's optimizer and with the CPU one; the CPU one steps each parameter once,
    during backward from its reduced gradient, committed at step(), bit-identical to stepping in step() only
    (TIERFLOW_OVERLAP_STEP=off), and has nothing to say."""
    for rank, runs in enumerate(ddp_runs):
        base = _as_run(runs[("ddp", None)])
        kept, ours = runs[(order, acts, "none")], runs[(order, acts, "host")]
        for r in (kept, ours):
            assert r["error"] is None, f"rank {rank}: {r['error']}"
            assert len(r["losses"]) == STEPS
            if acts == "host":
                assert r["offloaded_bytes"] > 0, "activations were meant to go to the host"
        # The user's optimizer: tierflow changes nothing in the arithmetic, and has nothing to say.
        assert_bit_identical(base, _as_run(kept))
        assert kept["warnings"] == [], kept["warnings"]
        # The CPU AdamW: within its rounding (harness.assert_close), and exactly what it computes when it
        # steps in step() only (TIERFLOW_OVERLAP_STEP=off, which asks for that without a warning).
        assert_close(base, _as_run(ours))
        off = runs[(order, "overlap off")]
        assert off["error"] is None and off["warnings"] == [], off
        if acts == "none":
            assert_bit_identical(_as_run(off), _as_run(ours))
        # Every step during backward, from the reduced gradient (tierflow's DDP communication hook): committed.
        _assert_all_committed(ours["overlap"], f"rank {rank}")
        assert ours["warnings"] == [], ours["warnings"]
    # DDP keeps the replicas equal.
    for opt in ("none", "host"):
        for k, v in ddp_runs[0][(order, acts, opt)]["params"].items():
            assert torch.equal(v, ddp_runs[1][(order, acts, opt)]["params"][k]), f"ranks differ in {k} ({opt})"


FED_CASES = ["bucket view", "small buckets", "no_sync", "no_sync told", "static graph", "unused found", "hook after",
             "join"]


@pytest.mark.parametrize("order,case", [(o, c) for o in ORDERS for c in FED_CASES
                                        if o == "wrap(DDP)" or c in BOTH_ORDERS])
def test_ddp_settings_step_during_backward_from_the_reduced_gradients(ddp_runs, order, case):
    """gradient_as_bucket_view, several DDP buckets (each reduced bucket streams by itself), uneven inputs under
    DDP's join(), no_sync accumulation
    (with TIERFLOW_GRAD_ACCUMULATION_STEPS left at 1 or set to the micro-batches per step: the reducing backward
    streams either way), static_graph, find_unused_parameters,
    and a comm hook of the user's registered after tierflow.wrap (it runs in
    place of tierflow's all-reduce; what it returns streams): DDP's results with the same settings, every step
    committed."""
    for rank, runs in enumerate(ddp_runs):
        ours = runs[(order, case)]
        assert ours["error"] is None, f"rank {rank}: {ours['error']}"
        assert ours["warnings"] == [], ours["warnings"]
        assert_close(_as_run(runs[("ddp", case)]), _as_run(ours))
        if order == "wrap(DDP)" and case in EXACT:  # the steps during backward are step()'s, bit for bit
            assert_bit_identical(_as_run(runs[(order, case, "overlap off")]), _as_run(ours))
        _assert_all_committed(ours["overlap"], f"rank {rank}", unused=2 if case == "unused found" else 0)
        if case == "join":  # rank 1 ran out of inputs: join's shadow passes ran tierflow's hook, outside backward
            assert len(ours["losses"]) == STEPS - rank
            assert ours["after_join"] == ours["overlap"][-1], "nothing streams from join's shadow all-reduces"
        if case == "unused found":  # never stepped, as torch's AdamW skips a parameter without a gradient
            for k in ("spare.weight", "spare.bias"):
                assert torch.equal(ours["params"][k], runs[("ddp", case)]["params"][k]), k
    for k, v in ddp_runs[0][(order, case)]["params"].items():
        assert torch.equal(v, ddp_runs[1][(order, case)]["params"][k]), f"ranks differ in {k}"


@pytest.mark.parametrize("order", ORDERS)
def test_tierflows_clip_under_ddp_redoes_only_the_steps_where_it_binds(ddp_runs, order):
    """TIERFLOW_MAX_GRAD_NORM under DDP clips the reduced gradients as clip_grad_norm_ after DDP's backward does:
    where the clip binds (DDP's own norm says so) the early steps are redone and none is committed; where it
    does not, all are committed."""
    for rank, runs in enumerate(ddp_runs):
        base, ours = runs[("ddp", "clip binds")], runs[(order, "clip binds")]
        assert ours["error"] is None and ours["warnings"] == [], (ours["error"], ours["warnings"])
        assert_close(_as_run(base), _as_run(ours))
        binds = [norm > 0.25 for norm in base["norms"]]
        assert any(binds) and not all(binds), base["norms"]  # both kinds of step are seen
        for i, (c, bound) in enumerate(zip(_per_step(ours["overlap"]), binds)):
            if bound:  # speculation stops once the running norm crosses the bound: the buckets before it redone
                assert c["committed"] == 0 and 0 < c["redone"] == c["early_steps"] < PARAMS, (rank, i, c)
            else:
                assert c == dict(early_steps=PARAMS, committed=PARAMS, redone=0), (rank, i, c)


@pytest.mark.parametrize("order", ORDERS)
def test_a_comm_hook_registered_before_tierflow_sees_ddp_turns_the_steps_during_backward_off(ddp_runs, order):
    """DDP takes one communication hook: with the user's there before tierflow sees the DDP module, the CPU
    optimizer steps after backward (from what the user's hook made), and says why and what to do, once."""
    for rank, runs in enumerate(ddp_runs):
        ours = runs[(order, "hook before")]
        assert ours["error"] is None, ours["error"]
        assert_close(_as_run(runs[("ddp", "hook before")]), _as_run(ours))
        assert all(c["early_steps"] == 0 for c in ours["overlap"]), ours["overlap"]
        assert len(ours["warnings"]) == 1, ours["warnings"]
        warning = ours["warnings"][0]
        assert "a DDP communication hook is registered on it already (halved" in warning, warning
        assert "register yours after tierflow.wrap" in warning and "steps after backward" in warning, warning


def test_a_builtin_comm_hook_after_tierflow_is_refused(ddp_runs):
    for runs in ddp_runs:
        error = runs[("wrap(DDP)", "builtin hook after")]["error"]
        assert error is not None and "_register_builtin_comm_hook" in error, error
        assert "ddp.register_comm_hook(state, hook)" in error, error


@pytest.mark.parametrize("order", ORDERS)
def test_offload_gradients_under_ddp_is_refused(ddp_runs, order):
    for runs in ddp_runs:
        error = runs[(order, "offload gradients")]["error"]
        assert error is not None, "TIERFLOW_OFFLOAD_GRADIENTS=on under DDP must be refused"
        assert "TIERFLOW_OFFLOAD_GRADIENTS=on" in error and "DistributedDataParallel" in error, error
        assert "offload_gradients='off'" in error, error


def test_gradients_all_reduced_by_hand_stop_the_steps_during_backward(ddp_runs):
    """An all-reduce tierflow cannot see (written by hand between backward() and step()) shows at the
    first step, whose early steps are all redone: from then on the optimizer steps in step() only."""
    for rank, runs in enumerate(ddp_runs):
        base, ours = runs[("by hand", None)], runs[("by hand", "wrap")]
        assert ours["error"] is None, ours["error"]
        assert_close(_as_run(base), _as_run(ours))
        first, last = ours["overlap"][0], ours["overlap"][-1]
        assert first["early_steps"] > 0 and first["redone"] == first["early_steps"], first
        assert last["early_steps"] == first["early_steps"] and last["redone"] == first["redone"], (first, last)
        assert len(ours["warnings"]) == 1 and "steps after backward" in ours["warnings"][0], ours["warnings"]
        assert "all-reduce" in ours["warnings"][0] and "2-process" in ours["warnings"][0], ours["warnings"][0]


# ---- FSDP2: activations offloaded, the user's optimizer stepping the shards ---------------------------------------

FSDP_STEPS = 5  # auto: two profiling steps, then its plan for three
FSDP_ACTS = ("none", "host", "recompute", "auto", "auto tight")
FSDP_ORDERS = ("wrap(fully_shard)", "fully_shard(wrap)")
FSDP_CPU_ACTS = ("none", "host", "auto")

# Two ranks, four transformer-like blocks each its own FSDP2 unit and the root one more (reshard_after_forward: the
# unsharded parameters are freed after each block's forward and gathered again for its backward).
_FSDP_WORKER = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    sys.path[:0] = [{bindings!r}]
    import tierflow
    from torch.distributed.fsdp import fully_shard

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    FSDP_STEPS = {steps}

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))

    class Net(nn.Module):
        def __init__(self, d=64, n=4):
            super().__init__()
            self.inp, self.out = nn.Linear(16, d), nn.Linear(d, 4)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)

    def shard(model):
        for b in model.blocks:
            fully_shard(b)
        return fully_shard(model)

    def run(order, acts=None, budget=None, optimizer="none"):
        torch.manual_seed(0)
        model = Net()
        settings = dict(device="emulated", offload_activations=acts, offload_optimizer=optimizer,
                        min_offload_bytes=0, prefetch_bytes="64KiB", cpu_threads=1)
        if acts == "auto tight":
            settings.update(offload_activations="auto", gpu_memory=str(budget))
        if order == "fully_shard(wrap)":  # wrap first: tierflow finds FSDP2 at the first forward
            settings.pop("offload_optimizer")  # no optimizer to replace: the default's CPU optimizer is not made
            model, _ = tierflow.wrap(model, None, **settings)
        shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)  # steps FSDP2's shards
        if order == "wrap(fully_shard)":
            model, opt = tierflow.wrap(model, opt, **settings)
        out = dict(losses=[])
        for step in range(FSDP_STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
            x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
        out["shards"] = {{n: p.to_local().detach().clone() for n, p in model.named_parameters()}}
        out["numel"] = sum(p.numel() for p in model.parameters())  # all ranks' shards together
        if isinstance(opt, tierflow.CPUAdamW):  # what this rank holds of the states: its shards' only
            out["state_numel"] = {{k: sum(s[k].numel() for s in opt.state.values())
                                  for k in ("master", "exp_avg", "exp_avg_sq")}}
            out["off"] = tierflow.report()["optimizer"].get("steps_during_backward_off")
            out["table"] = str(tierflow.report())
        if order is not None:
            report = tierflow.report()
            out.update(packs=report["activations"]["packs"], offloaded=report["activations"]["offloaded_bytes"],
                       plan=report.get("plan"))
            tierflow.unwrap(model)
        return out

    results = dict(baseline=run(None))
    for order in {orders}:
        for acts in {acts}:
            budget = None
            if acts == "auto tight":  # room for half of what the blocks save beside the rest of training
                plan = results[(order, "auto")]["plan"]
                budget = plan["predicted_device_peak_bytes"] - plan["kept_bytes"] // 2
            results[(order, acts)] = run(order, acts, budget)
    for acts in {cpu_acts}:  # tierflow's CPU AdamW stepping each rank's shard
        results[("wrap(fully_shard)", acts, "host")] = run("wrap(fully_shard)", acts, optimizer="host")

    def checkpointed(optimizer, dtype=torch.float32):
        # torch.distributed.checkpoint (DCP) after 3 steps; the run goes on 2 more, and a new run (new model,
        # new optimizer, wrapped, its state loaded from DCP) takes those 2 steps again.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def make():
            torch.manual_seed(0)
            model = shard(Net().to(dtype))  # bf16: the CPU AdamW's fp32 masters go through the checkpoint too
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            return tierflow.wrap(model, opt, device="emulated", offload_activations="auto",
                                 offload_optimizer=optimizer, min_offload_bytes=0, prefetch_bytes="64KiB",
                                 cpu_threads=1)

        def train(model, opt, steps):
            losses = []
            for step in steps:
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(64, 16, generator=g).to(dtype), torch.randn(64, 4, generator=g).to(dtype)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses

        path = os.path.join(os.path.dirname(store), f"dcp-{{optimizer}}-{{dtype}}")
        model, opt = make()
        train(model, opt, range(3))
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save(dict(model=model_sd, optim=optim_sd), checkpoint_id=path)
        on = train(model, opt, range(3, 5))
        went_on = {{n: p.to_local().detach().clone() for n, p in model.named_parameters()}}
        tierflow.unwrap(model)
        model, opt = make()
        model_sd, optim_sd = get_state_dict(model, opt)
        loaded = dict(model=model_sd, optim=optim_sd)
        dcp.load(loaded, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        again = train(model, opt, range(3, 5))
        resumed = {{n: p.to_local().detach().clone() for n, p in model.named_parameters()}}
        tierflow.unwrap(model)
        return dict(went_on=on, resumed=again, shards_went_on=went_on, shards_resumed=resumed)

    for optimizer in ("none", "host"):
        results[("checkpoint", optimizer)] = checkpointed(optimizer)
    results[("checkpoint", "host", "bf16")] = checkpointed("host", torch.bfloat16)

    def gpt2(acts=None, optimizer="none"):
        # transformers' GPT-2 with its default config (dropout on), each block an FSDP2 unit.
        import transformers
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                                                     n_positions=32))
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        if acts is not None:
            model, opt = tierflow.wrap(model, opt, device="emulated", offload_activations=acts,
                                       offload_optimizer=optimizer, min_offload_bytes=0, cpu_threads=1)
        losses = []
        for step in range(FSDP_STEPS):
            ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        shards = {{n: p.to_local().detach().clone() for n, p in model.named_parameters()}}
        if acts is not None:
            tierflow.unwrap(model)
        return dict(losses=losses, shards=shards)

    results[("gpt2", None, None)] = gpt2()
    for acts, optimizer in (("host", "none"), ("auto", "none"), ("auto", "host")):
        results[("gpt2", acts, optimizer)] = gpt2(acts, optimizer)
    torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Per rank, {case: what that rank saw}: FSDP2 without tierflow, and with it in both orders."""
    d = tmp_path_factory.mktemp("fsdp")
    script = _FSDP_WORKER.format(bindings=os.path.join(ROOT, "bindings", "python"), steps=FSDP_STEPS,
                                 orders=FSDP_ORDERS, acts=FSDP_ACTS, cpu_acts=FSDP_CPU_ACTS)
    return _run_ranks(d, script)


@pytest.mark.parametrize("order", FSDP_ORDERS)
@pytest.mark.parametrize("acts", FSDP_ACTS)
def test_fsdp2_with_offloaded_activations_trains_as_fsdp2_alone(fsdp_runs, order, acts):
    """Bit for bit FSDP2's own run on each rank: losses and each rank's parameter shards. What moves is only
    activations: FSDP2's unsharded parameters (freed after each block's forward, gathered again for backward)
    are never copied, and the replays of recompute and auto run the blocks' forwards without FSDP2's hooks."""
    for rank, results in enumerate(fsdp_runs):
        base, run = results["baseline"], results[(order, acts)]
        assert run["losses"] == base["losses"], (rank, run["losses"], base["losses"])
        assert run["shards"].keys() == base["shards"].keys()
        for name, shard in base["shards"].items():
            assert torch.equal(run["shards"][name], shard), (rank, name)
        if acts == "none":
            assert run["offloaded"] == 0, run
            continue
        assert run["packs"] > 0, run
        # What a step saves: the blocks' activations, not their parameters (64 x 64 floats and 64 x 256 floats
        # per block's linear layers: no parameter shard or unsharded weight of 64 x 256 floats is among them).
        if acts == "host":
            assert 0 < run["offloaded"] < FSDP_STEPS * 4 * 64 * (3 * 64 + 3 * 256) * 4, run
        if acts.startswith("auto"):
            modes = run["plan"]["modes"]
            assert len(modes) == 4, run["plan"]
            assert set(modes) == {"keep"} if acts == "auto" else set(modes) != {"keep"}, run["plan"]["summary"]


@pytest.mark.parametrize("acts", FSDP_CPU_ACTS)
def test_fsdp2_with_the_cpu_optimizer_steps_each_ranks_shard(fsdp_runs, acts):
    """tierflow's CPU AdamW under FSDP2 (ZeRO-Offload's design on FSDP2's shards): FSDP2's results within the CPU
    AdamW's rounding, and each rank holds the states of its own shard only: one copy of them on the node."""
    for rank, results in enumerate(fsdp_runs):
        base, run = results["baseline"], results[("wrap(fully_shard)", acts, "host")]
        assert_close(Run(losses=base["losses"], params=base["shards"]), Run(losses=run["losses"], params=run["shards"]))
        shards = sum(t.numel() for t in run["shards"].values())
        assert run["state_numel"] == {"master": shards, "exp_avg": shards, "exp_avg_sq": shards}, run["state_numel"]
        # Nothing silent: the report says that, and why, every shard steps in step() (not during backward).
        assert "FSDP2" in run["off"] and "steps in step()" in run["off"], run["off"]
        assert "steps during backward" in run["table"] and "off: FSDP2" in run["table"], run["table"]
    total = fsdp_runs[0][("wrap(fully_shard)", acts, "host")]["numel"]
    held = [results[("wrap(fully_shard)", acts, "host")]["state_numel"]["exp_avg"] for results in fsdp_runs]
    assert sum(held) == total and all(0 < h < total for h in held), (held, total)


@pytest.mark.parametrize("case", [("none",), ("host",), ("host", "bf16")], ids=["torch AdamW", "CPU AdamW",
                                                                            "CPU AdamW bf16"])
def test_fsdp2_checkpoints_through_dcp_resume_bit_for_bit(fsdp_runs, case):
    """torch.distributed.checkpoint (get_state_dict, dcp.save, dcp.load, set_state_dict) of a wrapped FSDP2 model and
    its optimizer, the user's or tierflow's CPU AdamW (whose states of each rank's shard go out as DTensors, fp32
    masters of bf16 parameters included, without touching the states it steps): a new run loaded from it takes
    the next steps exactly as the run that went on after the checkpoint, on each rank."""
    for rank, results in enumerate(fsdp_runs):
        r = results[("checkpoint", *case)]
        assert r["resumed"] == r["went_on"], (rank, r)
        for name, shard in r["shards_went_on"].items():
            assert torch.equal(r["shards_resumed"][name], shard), (rank, name)


@pytest.mark.parametrize("acts,optimizer", [("host", "none"), ("auto", "none"), ("auto", "host")])
def test_fsdp2_trains_transformers_gpt2_as_fsdp2_alone(fsdp_runs, acts, optimizer):
    """A model nobody here wrote, with its default config (dropout on): transformers' GPT-2, each block an FSDP2
    unit. The user's optimizer: bit for bit FSDP2 alone; tierflow's CPU AdamW: within its rounding."""
    for rank, results in enumerate(fsdp_runs):
        base, run = results[("gpt2", None, None)], results[("gpt2", acts, optimizer)]
        if optimizer == "none":
            assert run["losses"] == base["losses"], (rank, run["losses"], base["losses"])
            for name, shard in base["shards"].items():
                assert torch.equal(run["shards"][name], shard), (rank, name)
        else:
            assert_close(Run(losses=base["losses"], params=base["shards"]),
                         Run(losses=run["losses"], params=run["shards"]))


def test_fsdp2_on_one_cuda_rank_with_the_cpu_optimizer_trains_and_checkpoints(device, tmp_path, monkeypatch):
    """FSDP2's CUDA path on one GPU (an NCCL group of one process): the CPU AdamW copies each local shard's gradient
    to the host and its new value back, activations go to the host, within its rounding of FSDP2 with torch's
    AdamW; its states stay in host memory, in the checkpoint's DTensors too, and DCP saves them."""
    if device != "cuda":
        pytest.skip("FSDP2 on CUDA; on the emulated device the two-rank gloo tests above cover FSDP2")
    dist = torch.distributed
    if not dist.is_nccl_available() or dist.is_initialized():
        pytest.skip("needs NCCL and no process group yet in this process")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        runs = {}
        for kind in ("torch", "tierflow"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)).cuda()
            for i in (0, 2, 4):
                fully_shard(model[i])
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            if kind == "tierflow":
                model, opt = tierflow.wrap(model, opt, device="cuda", offload_activations="host", min_offload_bytes=0)
            losses = []
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(32, 16, generator=g).cuda(), torch.randn(32, 4, generator=g).cuda()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            shards = {n: p.to_local().detach().cpu() for n, p in model.named_parameters()}
            runs[kind] = Run(losses=losses, params=shards)
            if kind == "tierflow":
                assert tierflow.report()["activations"]["offloaded_bytes"] > 0
                assert all(t.device.type == "cpu" for s in opt.state.values() for t in s.values()
                           if isinstance(t, torch.Tensor))
                allocated = torch.cuda.memory_allocated()
                model_sd, optim_sd = get_state_dict(model, opt)
                local = [v.to_local() for s in optim_sd["state"].values() for v in s.values() if hasattr(v, "to_local")]
                assert local and all(t.device.type == "cpu" for t in local), "the states stay in host memory"
                assert torch.cuda.memory_allocated() <= allocated + (1 << 20), "no copy of the states on the GPU"
                dcp.save(dict(model=model_sd, optim=optim_sd), checkpoint_id=str(tmp_path / "dcp"))
                tierflow.unwrap(model)
        assert_close(runs["torch"], runs["tierflow"])
    finally:
        dist.destroy_process_group()


NVME = "<nvme>"  # the test's NVMe directory
REFUSED_WITH_FSDP2 = [dict(offload_optimizer="nvme", nvme_paths=NVME), dict(offload_gradients="on"),
                      dict(gpu_optimizer_fraction="0.5"), dict(offload_optimizer="none", offload_params="host")]
REFUSED_SETTING = ["TIERFLOW_OFFLOAD_OPTIMIZER='nvme'", "TIERFLOW_OFFLOAD_GRADIENTS='on'",
                   "TIERFLOW_GPU_OPTIMIZER_FRACTION=0.5", "TIERFLOW_OFFLOAD_PARAMS='host'"]


@pytest.mark.parametrize("settings,setting", list(zip(REFUSED_WITH_FSDP2, REFUSED_SETTING)),
                         ids=["nvme optimizer", "offloaded gradients", "gpu share", "params"])
@pytest.mark.parametrize("sharded", ["blocks and root", "one block"])
def test_fsdp2_with_settings_it_cannot_train_is_refused_and_leaves_nothing(world_of_one, sharded, settings, setting,
                                                                          nvme_dir):
    """What FSDP2's shards do not take yet (NVMe optimizer states, gradients freed during backward, the GPU share)
    and parameter offload (which would move what FSDP2 gathers): refused at wrap, naming the setting and what FSDP2
    accepts; nothing left behind."""
    settings = {k: ([nvme_dir] if v == NVME else v) for k, v in settings.items()}
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    if sharded == "blocks and root":
        for i in (0, 2, 4):
            fully_shard(model[i])
        fully_shard(model)
    else:
        fully_shard(model[2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = _hooks(model)
    with pytest.raises(tierflow.TierflowError, match=r"fully_shard \(FSDP2\)") as refused:
        tierflow.wrap(model, opt, device="emulated", **settings)
    message = str(refused.value)
    assert setting in message and "accepted with FSDP2: TIERFLOW_OFFLOAD_OPTIMIZER=host" in message, message
    # Nothing left behind: no session, no hook, the optimizer as it was; FSDP2 trains on.
    assert getattr(model, "_tierflow_session", None) is None
    assert _hooks(model) == hooks
    assert type(opt) is torch.optim.AdamW and opt.state == {}
    losses = _train_steps(model, opt)
    assert all(torch.isfinite(torch.tensor(losses))), losses


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _hooks(model: nn.Module) -> dict:
    """Every module hook tierflow.wrap may install, by module."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_state_dict_pre_hooks",
             "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
    return {name: tuple(tuple(getattr(m, k).keys()) for k in kinds) for name, m in model.named_modules()}


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> list:
    losses = []
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_ddp_join_dividing_by_the_ranks_left_is_refused_with_the_steps_during_backward(world_of_one):
    """join(divide_by_initial_world_size=False) divides by the ranks that have not joined, which DDP tells only its
    own reduction; tierflow's hook (registered to step during backward) would divide by the world size."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    net, opt = tierflow.wrap(DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-2), device="emulated",
                             offload_activations="none", offload_optimizer="host")
    x = torch.randn(4, 8)
    with net.join():  # the default, dividing by the initial world size, is what the hook does
        net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert opt.overlap_stats["committed"] == 6, opt.overlap_stats
    with pytest.raises(Exception, match=r"divide_by_initial_world_size=False.*accepted: join\(\) with "
                                        r"divide_by_initial_world_size=True") as refused:
        with net.join(divide_by_initial_world_size=False):
            net(x).square().mean().backward()
    assert "TIERFLOW_OVERLAP_STEP=off" in str(refused.value)
    tierflow.unwrap(net)


@pytest.mark.parametrize("settings", [dict(), dict(offload_activations="none")], ids=["defaults", "no activations"])
def test_fully_shard_after_wrap_with_the_cpu_optimizer_is_refused_at_the_first_forward(world_of_one, settings):
    """The CPU optimizer made at wrap holds the parameters from before fully_shard replaced them."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="emulated",
                               min_offload_bytes=0, **settings)
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    x = torch.randn(4, 8)
    for _ in range(2):  # refused at every forward, not only the first
        with pytest.raises(tierflow.TierflowError, match=r"fully_shard \(FSDP2\) was applied to the model after "
                                                         r"tierflow.wrap") as refused:
            model(x).sum().backward()
        message = str(refused.value)
        assert "call fully_shard before tierflow.wrap" in message and "tierflow.unwrap(model)" in message, message
    report = tierflow.report()
    assert report["activations"]["packs"] == 0 and report["activations"]["offloaded_bytes"] == 0, \
        "refused before anything was saved"
    tierflow.unwrap(model)  # what the message offers: FSDP2 without tierflow then trains
    losses = _train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert all(torch.isfinite(torch.tensor(losses))), losses


def test_the_cpu_optimizer_over_a_partly_sharded_model_is_refused(world_of_one):
    """fully_shard on one block only: its parameters are DTensor shards, the others plain, whose gradients FSDP2
    does not reduce; the CPU optimizer would step both kinds (and take one norm over both): refused, naming them."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    fully_shard(model[2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = _hooks(model)
    with pytest.raises(tierflow.ConfigError, match=r"2 of its 6 parameters are FSDP2's DTensor shards and 4 are not "
                                                   r"\('0.weight', '0.bias', '4.weight' and more\).*only partly "
                                                   r"under fully_shard"):
        tierflow.wrap(model, opt, device="emulated")
    assert getattr(model, "_tierflow_session", None) is None and _hooks(model) == hooks
    assert type(opt) is torch.optim.AdamW


def test_optimizer_holding_dtensor_parameters_is_refused(world_of_one):
    """An optimizer of another, sharded model: its DTensors are not the wrapped model's."""
    from torch.distributed.fsdp import fully_shard

    model, sharded = _mlp(), fully_shard(_mlp())
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    hooks = _hooks(model)
    with pytest.raises(tierflow.TierflowError, match=r"6 of the optimizer's 6 parameters are DTensors.*"
                                                     r"the model has no FSDP2 module.*another model's"):
        tierflow.wrap(model, opt, device="emulated", offload_optimizer="none")
    assert getattr(model, "_tierflow_session", None) is None and _hooks(model) == hooks


def test_dtensor_parameters_of_tensor_parallelism_are_refused(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _mlp()
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with pytest.raises(tierflow.TierflowError, match=r"4 of the model's parameters are DTensors \('0.weight'.*"
                                                     r"no module of it is an FSDP2 module.*tensor parallelism.*"
                                                     r"fully_shard \(FSDP2\) or DistributedDataParallel"):
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", offload_optimizer="none")
    assert getattr(model, "_tierflow_session", None) is None
