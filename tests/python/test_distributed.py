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
FSDP2 is in test_fsdp2.py.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

import tierflow
from harness import Run, assert_bit_identical, assert_close
from ranks import GLOO, mlp, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [GLOO, pytest.mark.ordering]  # the ranks train in children (Note [Test tiers])

STEPS = 3
SETTINGS = [(acts, opt) for acts in ("none", "host", "auto") for opt in ("none", "host", "nvme")]
ORDERS = ("wrap(DDP)", "DDP(wrap)")
# The DDP settings run in both orders (the others, once tierflow's hook is registered, feed the same way: wrap(DDP)
# only). tierflow sees DDP(wrap) at the first forward: a hook registered before that is the "hook before" case.
BOTH_ORDERS = ("bucket view", "no_sync", "static graph", "clip binds", "hook before", "partitioned")
# ... and those also run with TIERFLOW_OVERLAP_STEP=off, to compare the steps during backward with, bit for bit.
EXACT = ("bucket view", "small buckets", "no_sync", "hook after")

# One script, run by each of the two ranks: every DDP case in one process group (starting the
# processes costs more than all the training). Each rank saves what it saw; the tests compare.
_WORKER = textwrap.dedent("""
    import contextlib, datetime, os, sys, warnings
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.algorithms.join import Join
    sys.path[:0] = [{bindings!r}]
    import tierflow
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (run_ranks ends the rest)
    torch.set_num_threads(1)
    STEPS = {steps}
    NVME = os.path.join(os.path.dirname(store), "nvme")  # both ranks' swap files, named by rank
    os.makedirs(NVME, exist_ok=True)

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

    def run(parallel, order, ddp=None, clip=None, no_sync=False, hook=None, join=False, frozen=False, **settings):
        # ddp: DDP's keyword arguments; clip: clip_grad_norm_'s max_norm (tierflow's max_grad_norm when
        # wrapped); no_sync: each step a first micro-batch under DDP's no_sync; hook: (when, hook) registered
        # on the DDP module "before" tierflow sees it or "after" tierflow.wrap(DDP(model)); join: uneven inputs
        # (rank 1 has one step less) under DDP's join(); frozen: the first layer's weight does not train.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        model[0].weight.requires_grad_(not frozen)
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
                        (loss / 2 if parallel == "by hand, pre-divided" else loss).backward()
                        if parallel == "by hand":  # what DDP does, written out: average the gradients
                            for p in model.parameters():
                                dist.all_reduce(p.grad)
                                p.grad.div_(2)
                        elif parallel == "by hand, pre-divided":  # the loss divided instead: the all-reduce's
                            for p in model.parameters():          # write is all, and it moves no version counter
                                dist.all_reduce(p.grad)
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
                    # Note [Partitioned optimizer]: what this rank steps and keeps states of.
                    result["owned"] = [n for n, p in model.named_parameters() if opt.owns(p)]
                    result["state_elements"] = sum(s["exp_avg"].numel() for s in opt.state.values() if "exp_avg" in s)
                    result["partition"] = opt.partition_stats()
                    result["table"] = str(tierflow.report())
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
             "builtin hook after": dict(hook=("after", "builtin")),
             # Note [Partitioned optimizer]: under join() a rank that ran out of inputs takes no step(), so the
             # owners' broadcasts cannot be matched: join runs unpartitioned, and partitioned it is refused.
             "join": dict(join=True), "join partitioned": dict(join=True, partition_optimizer="on"),
             "partitioned": dict(partition_optimizer="on"),
             "frozen": dict(frozen=True), "frozen partitioned": dict(frozen=True, partition_optimizer="on")}}
    results = {{("ddp", None): run("ddp", None), ("by hand", None): run("by hand", None),
               ("by hand", "wrap"): run("by hand", "wrap", offload_activations="none", offload_optimizer="host"),
               ("by hand, pre-divided", None): run("by hand, pre-divided", None),
               ("by hand, pre-divided", "wrap"): run("by hand, pre-divided", "wrap", offload_activations="none",
                                                     offload_optimizer="host")}}
    for order in {orders!r}:
        for acts, opt in {settings!r}:
            nvme = dict(nvme_paths=NVME, nvme_memory="256MiB") if opt == "nvme" else {{}}
            results[(order, acts, opt)] = run("ddp", order, offload_activations=acts, offload_optimizer=opt, **nvme)
        results[(order, "overlap off")] = run("ddp", order, offload_activations="none", offload_optimizer="host",
                                              overlap_step="off")
        results[(order, "offload gradients")] = run("ddp", order, offload_activations="none",
                                                    offload_optimizer="host", offload_gradients="on")
    for name, case in CASES.items():
        if name not in ("builtin hook after", "join partitioned", "partitioned", "frozen partitioned"):
            results[("ddp", name)] = run("ddp", None, **case)
        for order in {orders!r}:
            if order == "DDP(wrap)" and name not in {both_orders!r}:
                continue  # the same feeding once registered: the order's own cases only
            results[(order, name)] = run("ddp", order, offload_activations="none", offload_optimizer="host", **case)
        if name == "partitioned":  # and with the optimizer states on NVMe, partitioned and not
            for order in {orders!r}:
                for partition in ("on", "off"):
                    results[(order, "nvme", partition)] = run(
                        "ddp", order, offload_activations="none", offload_optimizer="nvme", nvme_paths=NVME,
                        nvme_memory="256MiB", partition_optimizer=partition)
        # What the CPU AdamW computes stepping in step() only, to compare the steps during backward with.
        if name in {exact!r}:
            results[("wrap(DDP)", name, "overlap off")] = run("ddp", "wrap(DDP)", offload_activations="none",
                                                              offload_optimizer="host", overlap_step="off", **case)
    torch.save(results, out_path)
    dist.destroy_process_group()
    # torch's gloo may abort at exit once a broadcast ran beside DDP's all-reduces ("terminate called without an
    # active exception" after Python's finalization: reproduced without tierflow, plain DDP and a broadcast a step,
    # 3 of 40 runs; the partitioned optimizer broadcasts every step). What the test reads is saved: skip the teardown,
    # once every session is closed (their swap files go with them).
    import gc
    gc.collect()
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> list:
    """Per rank, {case: what that rank saw}; both ranks run every case of the worker script."""
    d = tmp_path_factory.mktemp("ddp")
    script = _WORKER.format(bindings=os.path.join(ROOT, "bindings", "python"), steps=STEPS, orders=ORDERS,
                            settings=SETTINGS, both_orders=BOTH_ORDERS, exact=EXACT)
    return run_ranks(d, script)


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
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (run_ranks ends the rest)
    torch.manual_seed(0)
    model, _ = tierflow.wrap(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)), None, **settings)
    loss = model(torch.randn(8, 16)).sum()
    rt = tierflow.current_session().runtime
    # The write-behind to NVMe is asynchronous: a backward that came before it
    # would take the blocks back from staging and write nothing. Settle the
    # copies (which starts the writes) and wait for one to land, not for time.
    deadline = time.monotonic() + 600  # a hang guard, generous for a loaded machine
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
    outs = run_ranks(tmp_path, script)
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


def _stepped(result: dict) -> int:
    """The parameters of the MLP this rank steps: all of them, or its own under the partitioned optimizer."""
    return sum(not n.startswith("spare.") for n in result["owned"])


def _assert_all_committed(result: dict, where: str, unused: bool = False) -> None:
    """Every parameter this rank steps stepped during backward, from the reduced gradient, and committed: nothing
    redone. An unused parameter (find_unused_parameters) streams DDP's zeros, and its step is taken back (p.grad
    stays None)."""
    stepped = _stepped(result)
    spare = sum(n.startswith("spare.") for n in result["owned"]) if unused else 0
    for i, c in enumerate(_per_step(result["overlap"])):
        assert c == dict(early_steps=stepped + spare, committed=stepped, redone=0), f"{where}, step {i}: {c}"


@pytest.mark.parametrize("acts", ["none", "host", "auto"])
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
        _assert_all_committed(ours, f"rank {rank}")
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
        _assert_all_committed(ours, f"rank {rank}", unused=case == "unused found")
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
                # (partitioned, a rank's own buckets may all come before the stop)
                most = _stepped(ours) - (ours["partition"] is None)
                assert c["committed"] == 0 and 0 < c["redone"] == c["early_steps"] <= most, (rank, i, c)
            else:
                assert c == dict(early_steps=_stepped(ours), committed=_stepped(ours), redone=0), (rank, i, c)


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


def test_gradients_all_reduced_by_hand_without_a_version_change_are_stepped_as_reduced(ddp_runs):
    """A loss pre-divided by the world size and dist.all_reduce(p.grad) alone: the reduction's write moves no
    version counter, so only the gradients' content (Note [Gradient content]) shows that every early step was
    taken from the local gradient. Before, each rank committed its own and the ranks diverged."""
    for rank, runs in enumerate(ddp_runs):
        base, ours = runs[("by hand, pre-divided", None)], runs[("by hand, pre-divided", "wrap")]
        assert ours["error"] is None, ours["error"]
        assert_close(_as_run(base), _as_run(ours))
        assert all(o["committed"] == 0 for o in ours["overlap"]), ours["overlap"]
    assert torch.equal(ddp_runs[0][("by hand, pre-divided", "wrap")]["params"]["0.weight"],
                       ddp_runs[1][("by hand, pre-divided", "wrap")]["params"]["0.weight"]), "the ranks agree"


def test_ddp_join_dividing_by_the_ranks_left_is_refused_with_the_steps_during_backward(world_of_one):
    """join(divide_by_initial_world_size=False) divides by the ranks that have not joined, which DDP tells only its
    own reduction; tierflow's hook (registered to step during backward) would divide by the world size."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp()
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


# -- Note [Partitioned optimizer]: the CPU optimizer partitioned across DDP's ranks ----------------------------------
def test_the_partitioned_optimizer_steps_each_parameter_on_its_owner_alone_bit_for_bit_as_unpartitioned(ddp_runs):
    """TIERFLOW_PARTITION_OPTIMIZER=on under DDP (off is the default, unpartitioned): each parameter has one owner
    rank, which alone keeps its states and steps it (during backward, committed), and broadcasts its new weights;
    the results are, bit for bit, those of every rank stepping every parameter; the ranks' states add up to one
    copy of the model's, where unpartitioned each rank holds a whole copy. So with the states on NVMe (stepped in
    step())."""
    total = sum(v.numel() for v in ddp_runs[0][("ddp", None)]["params"].values())
    for order in ORDERS:
        owned = [set(runs[(order, "partitioned")]["owned"]) for runs in ddp_runs]
        assert owned[0] and owned[1] and not owned[0] & owned[1], owned
        assert owned[0] | owned[1] == set(ddp_runs[0][("ddp", None)]["params"]), owned
        elements = [runs[(order, "partitioned")]["state_elements"] for runs in ddp_runs]
        assert sum(elements) == total and max(elements) < total, (elements, total)
        shares = [runs[(order, "nvme", "on")]["partition"]["owned_elements"] for runs in ddp_runs]
        assert shares == elements, shares  # on NVMe, the same shares
        for rank, runs in enumerate(ddp_runs):
            ours, off = runs[(order, "partitioned")], runs[(order, "none", "host")]
            assert ours["error"] is None and ours["warnings"] == [], ours
            part = ours["partition"]
            assert part["rank"] == rank and part["world_size"] == 2 and part["broadcasts"] == STEPS, part
            assert part["owned_elements"] == ours["state_elements"] and part["elements"] == total, part
            _assert_all_committed(ours, f"rank {rank}, partitioned")
            assert "partitioned across ranks" in ours["table"], ours["table"]  # report()'s table says so
            assert f"rank {rank} of 2: {part['owned_parameters']} of 6 parameters" in ours["table"], ours["table"]
            assert f"{STEPS} weight broadcasts" in ours["table"], ours["table"]
            assert off["partition"] is None and off["state_elements"] == total, off  # the default
            assert_bit_identical(_as_run(off), _as_run(ours))
            nvme = runs[(order, "nvme", "on")]
            assert nvme["error"] is None and nvme["owned"] == ours["owned"], nvme["error"]
            assert_bit_identical(_as_run(runs[(order, "nvme", "off")]), _as_run(nvme))
        for k, v in ddp_runs[0][(order, "partitioned")]["params"].items():
            assert torch.equal(v, ddp_runs[1][(order, "partitioned")]["params"][k]), f"ranks differ in {k}"


def test_a_frozen_parameter_is_not_partitioned(ddp_runs):
    """A parameter that does not train (or one DDP does not reduce) has no reduced gradient to step from on an
    owner: every rank keeps it as its own, nothing of it is broadcast, and the partitioned run trains as the
    unpartitioned one, bit for bit."""
    for rank, runs in enumerate(ddp_runs):
        ours, off = runs[("wrap(DDP)", "frozen partitioned")], runs[("wrap(DDP)", "frozen")]
        assert ours["error"] is None and off["error"] is None, (ours["error"], off["error"])
        assert "0.weight" in ours["owned"], ours["owned"]  # every rank's
        assert_bit_identical(_as_run(off), _as_run(ours))
        assert torch.equal(ours["params"]["0.weight"], runs[("ddp", "frozen")]["params"]["0.weight"])  # untouched
    trained = [set(runs[("wrap(DDP)", "frozen partitioned")]["owned"]) - {"0.weight"} for runs in ddp_runs]
    assert not trained[0] & trained[1] and len(trained[0] | trained[1]) == PARAMS - 1, trained


def test_join_with_the_partitioned_optimizer_is_refused_on_every_rank_before_it_steps(ddp_runs):
    """Under DDP's join() a rank that ran out of inputs takes no step(): the owners' broadcasts could not be
    matched. The first step() inside join() refuses on every rank, naming the setting that works (join runs
    unpartitioned: test_ddp_settings_step_during_backward_from_the_reduced_gradients[wrap(DDP)-join])."""
    for runs in ddp_runs:
        ours = runs[("wrap(DDP)", "join partitioned")]
        assert ours["error"] is not None and ours["losses"] == [], ours
        assert "join() was entered" in ours["error"] and "TIERFLOW_PARTITION_OPTIMIZER=off" in ours["error"], ours

        assert "partition_optimizer='off'" in ours["error"], ours["error"]


@pytest.mark.parametrize("acts", ["none", "host", "auto"])
@pytest.mark.parametrize("order", ORDERS)
def test_ddp_with_the_optimizer_states_on_nvme_steps_in_step_as_the_host_tier_does(ddp_runs, order, acts):
    """TIERFLOW_OFFLOAD_OPTIMIZER=nvme under DDP (each rank's states in its own swap file): DDP's results within the
    CPU AdamW's rounding; every step in step() (the NVMe tier has no steps during backward), bit for bit what the
    host tier computes there (TIERFLOW_OVERLAP_STEP=off)."""
    for rank, runs in enumerate(ddp_runs):
        ours = runs[(order, acts, "nvme")]
        assert ours["error"] is None, f"rank {rank}: {ours['error']}"
        assert ours["warnings"] == [], ours["warnings"]
        assert_close(_as_run(runs[("ddp", None)]), _as_run(ours))
        assert all(c["early_steps"] == 0 for c in ours["overlap"]), ours["overlap"]
        if acts == "none":
            assert_bit_identical(_as_run(runs[(order, "overlap off")]), _as_run(ours))
    for k, v in ddp_runs[0][(order, acts, "nvme")]["params"].items():
        assert torch.equal(v, ddp_runs[1][(order, acts, "nvme")]["params"][k]), f"ranks differ in {k}"
