"""Note [Partitioned optimizer]: tierflow's CPU optimizer partitioned across DDP's ranks, in runs of their own (the
cases inside DDP's worker are in test_distributed.py): per-rank checkpoints that resume bit for bit and refuse
another rank's share, and four ranks."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from harness import Run, assert_bit_identical, assert_close
from ranks import GLOO, run_ranks
from test_distributed import PARAMS, ROOT, _as_run

pytestmark = [GLOO, pytest.mark.ordering]  # the ranks train in children (Note [Test tiers])


_CHECKPOINT_WORKER = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path[:0] = [{bindings!r}]
    import tierflow

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    d = os.path.dirname(store)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (run_ranks ends the rest)
    torch.set_num_threads(1)

    def make(partition="on"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        net, opt = tierflow.wrap(DDP(model), opt, device="emulated", offload_activations="none",
                                 partition_optimizer=partition, cpu_threads=1)
        return model, net, opt

    def train(net, opt, start, n):
        losses = []
        for step in range(start, start + n):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def params(model):
        return {{k: v.detach().clone() for k, v in model.state_dict().items()}}

    def states(opt):
        return [{{k: v.clone() for k, v in s.items()}} for s in opt.state.values()]

    out = {{}}
    model, net, opt = make()
    train(net, opt, 0, 2)
    torch.save(opt.state_dict(), os.path.join(d, f"opt{{rank}}.pt"))  # each rank its own
    torch.save(model.state_dict(), os.path.join(d, "model.pt")) if rank == 0 else None
    dist.barrier()
    out["went_on"], out["went_on_params"] = train(net, opt, 2, 2), params(model)
    tierflow.unwrap(net)

    model, net, opt = make()  # a new run resumes from the files
    model.load_state_dict(torch.load(os.path.join(d, "model.pt")))
    opt.load_state_dict(torch.load(os.path.join(d, f"opt{{rank}}.pt")))
    before = states(opt)
    try:  # another rank's partition: refused, nothing changed
        opt.load_state_dict(torch.load(os.path.join(d, f"opt{{1 - rank}}.pt")))
        out["other"] = None
    except tierflow.TierflowError as e:
        out["other"] = str(e)
    after = states(opt)
    out["unchanged"] = len(before) == len(after) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(before, after))
    out["resumed"], out["resumed_params"] = train(net, opt, 2, 2), params(model)
    tierflow.unwrap(net)

    # torch.distributed.checkpoint: get_state_dict (each rank's share; its fake zero step to make states runs on
    # every rank, the partition's all-reduce and broadcasts with it), dcp.save, and a new run's dcp.load and
    # set_state_dict, which needs strict=False: each rank holds the states of its share only (torch's strict
    # check wants one for every parameter; tierflow checks the share itself).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    model, net, opt = make()
    train(net, opt, 0, 2)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save(dict(model=model_sd, optim=optim_sd), checkpoint_id=os.path.join(d, "dcp"))
    out["dcp_went_on"], out["dcp_went_on_params"] = train(net, opt, 2, 2), params(model)
    tierflow.unwrap(net)
    model, net, opt = make()
    model_sd, optim_sd = get_state_dict(net, opt)
    loaded = dict(model=model_sd, optim=optim_sd)
    dcp.load(loaded, checkpoint_id=os.path.join(d, "dcp"))
    try:
        set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        out["dcp_strict"] = None
    except RuntimeError as e:
        out["dcp_strict"] = str(e)
    set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                   options=StateDictOptions(strict=False))
    out["dcp_elements"] = sum(s["exp_avg"].numel() for s in opt.state.values())
    out["dcp_resumed"], out["dcp_resumed_params"] = train(net, opt, 2, 2), params(model)
    tierflow.unwrap(net)

    model, net, opt = make("off")  # a whole state dict, saved without partitioning
    train(net, opt, 0, 2)
    whole, whole_model = opt.state_dict(), params(model)
    tierflow.unwrap(net)
    model, net, opt = make()
    model.load_state_dict(whole_model)
    opt.load_state_dict(whole)
    out["whole_elements"] = sum(s["exp_avg"].numel() for s in opt.state.values())
    out["whole_resumed"], out["whole_params"] = train(net, opt, 2, 2), params(model)
    out["owned_elements"] = opt.partition_stats()["owned_elements"]
    out["whole_in_use"] = tierflow.report()["host_pool"]["in_use"]["current"]
    tierflow.unwrap(net)

    # The whole state dict loaded before DDP is seen (DDP(wrap) order): every parameter's states, streamed, until
    # the partition drops the others' (the gradient stream lets go of its references too).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    model.load_state_dict(whole_model)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                               device="emulated", offload_activations="none", partition_optimizer="on",
                               cpu_threads=1)
    opt.load_state_dict(whole)
    net = DDP(model)
    out["late_resumed"], out["late_params"] = train(net, opt, 2, 2), params(model)
    out["late_in_use"] = tierflow.report()["host_pool"]["in_use"]["current"]
    out["late_elements"] = sum(s["exp_avg"].numel() for s in opt.state.values())
    tierflow.unwrap(model)

    model, net, opt = make("off")  # a share into an unpartitioned optimizer: refused
    try:
        opt.load_state_dict(torch.load(os.path.join(d, f"opt{{rank}}.pt")))
        out["into_whole"] = None
    except tierflow.TierflowError as e:
        out["into_whole"] = str(e)
    out["into_whole_states"] = len(opt.state)
    tierflow.unwrap(net)
    torch.save(out, out_path)
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


def test_a_partitioned_optimizer_saved_per_rank_resumes_bit_for_bit_and_refuses_another_ranks_state(tmp_path):
    """Note [Partitioned optimizer]: each rank saves its own optimizer state dict (its share of the states); a new
    run on as many ranks that loads its own resumes bit for bit (losses and parameters), and so does one saved and
    loaded through torch.distributed.checkpoint (get_state_dict, dcp.save, dcp.load, set_state_dict). Loading another rank's
    is refused, naming what to do, and changes nothing, as is loading a share into an unpartitioned optimizer; a
    whole state dict (saved unpartitioned) loads, each rank keeping its share, and resumes bit for bit too."""
    script = _CHECKPOINT_WORKER.format(bindings=os.path.join(ROOT, "bindings", "python"))
    outs = run_ranks(tmp_path, script)
    for rank, out in enumerate(outs):
        assert out["resumed"] == out["went_on"], (rank, out["resumed"], out["went_on"])
        assert_bit_identical(Run(losses=out["went_on"], params=out["went_on_params"]),
                             Run(losses=out["resumed"], params=out["resumed_params"]))
        assert out["other"] is not None and out["unchanged"], out["other"]
        assert f"holds rank {1 - rank}'s share" in out["other"] and f"this is rank {rank}" in out["other"], out["other"]
        assert "each rank loads the state dict it saved itself" in out["other"], out["other"]
        assert out["into_whole"] is not None and "this optimizer is not partitioned" in out["into_whole"]
        assert out["into_whole_states"] == 0, "nothing loaded"
        assert out["whole_elements"] == out["owned_elements"] == out["late_elements"], out
        assert out["late_in_use"] <= out["whole_in_use"], (out["late_in_use"], out["whole_in_use"])
        assert_bit_identical(Run(losses=out["went_on"], params=out["went_on_params"]),
                             Run(losses=out["late_resumed"], params=out["late_params"]))
        assert_bit_identical(Run(losses=out["went_on"], params=out["went_on_params"]),
                             Run(losses=out["whole_resumed"], params=out["whole_params"]))
        assert out["dcp_elements"] == out["owned_elements"], "through DCP too, each rank holds its share"
        assert "strict=False" in (out["dcp_strict"] or ""), "torch's own check names the option"
        assert_bit_identical(Run(losses=out["dcp_went_on"], params=out["dcp_went_on_params"]),
                             Run(losses=out["dcp_resumed"], params=out["dcp_resumed_params"]))
        assert_bit_identical(Run(losses=out["went_on"], params=out["went_on_params"]),
                             Run(losses=out["dcp_went_on"], params=out["dcp_went_on_params"]))


_FOUR_RANKS_WORKER = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path[:0] = [{bindings!r}]
    import tierflow

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (run_ranks ends the rest)
    torch.set_num_threads(1)
    out = {{}}
    for partition in ("on", "off", None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        net = DDP(model)
        if partition is not None:
            net, opt = tierflow.wrap(net, opt, device="emulated", offload_activations="host", min_offload_bytes=0,
                                     partition_optimizer=partition, cpu_threads=1)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        r = dict(losses=losses, params={{k: v.detach().clone() for k, v in model.state_dict().items()}})
        if partition is not None:
            r.update(owned=[n for n, p in model.named_parameters() if opt.owns(p)], overlap=dict(opt.overlap_stats),
                     states=sum(s["exp_avg"].numel() for s in opt.state.values()))
            tierflow.unwrap(net)
        out[partition] = r
    torch.save(out, out_path)
    dist.destroy_process_group()
    import gc
    gc.collect()  # every session closed
    sys.stdout.flush()
    os._exit(0)  # torch's gloo may abort at exit after broadcasts (see the DDP worker above)
""")


def test_four_ranks_partition_the_optimizer_and_train_as_every_rank_stepping_everything(tmp_path):
    """Four gloo ranks under DDP, activations on the host: the partitioned CPU AdamW (each of the MLP's six
    parameters on one of four ranks) trains bit for bit as the unpartitioned one and within its rounding of DDP
    with torch's AdamW; the ranks' states add up to one copy of the model's, and every step is committed."""
    outs = run_ranks(tmp_path, _FOUR_RANKS_WORKER.format(bindings=os.path.join(ROOT, "bindings", "python")), ranks=4)
    total = sum(v.numel() for v in outs[0][None]["params"].values())
    owned = [set(out["on"]["owned"]) for out in outs]
    assert set().union(*owned) == set(outs[0][None]["params"]) and sum(map(len, owned)) == PARAMS, owned
    assert sum(out["on"]["states"] for out in outs) == total and all(out["off"]["states"] == total for out in outs)
    for rank, out in enumerate(outs):
        on, off = _as_run(out["on"]), _as_run(out["off"])
        assert_bit_identical(off, on)
        assert_close(_as_run(out[None]), on)
        assert out["on"]["overlap"]["redone"] == 0 and out["on"]["overlap"]["committed"] == 3 * len(owned[rank])
        for k, v in out["on"]["params"].items():
            assert torch.equal(v, outs[0]["on"]["params"][k]), f"rank {rank} differs from rank 0 in {k}"


_AGREE_WORKER = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path[:0] = [{bindings!r}]
    import tierflow

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (run_ranks ends the rest)
    torch.set_num_threads(1)
    out = {{}}
    for case in ("failed", "skipped"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        net, opt = tierflow.wrap(DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-2), device="emulated",
                                 offload_activations="none", partition_optimizer="on", cpu_threads=1)
        if rank == 1:  # this rank's step() fails, or skips (as a gradient not finite here alone would make it)
            def injected():
                if case == "failed":
                    raise RuntimeError("injected failure")
                return True
            opt._step_all = injected
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        net(x).square().mean().backward()
        try:
            opt.step()
            out[case] = None
        except Exception as e:
            out[case] = str(e)
        tierflow.unwrap(net)
    torch.save(out, out_path)
    dist.barrier()
    import os
    os._exit(0)  # torch's gloo teardown aborts now and then after broadcasts (test_distributed.py)
""")


def test_a_rank_whose_partitioned_step_failed_or_skipped_alone_makes_every_rank_raise(tmp_path):
    """Note [Partitioned optimizer]: before the owners' weights move, the ranks agree on how step() went
    (optimizer::step_agreement_refusal): a rank that failed raises its own error and the others say another rank
    failed; a rank that skipped alone makes every rank raise; no rank waits in a broadcast."""
    outs = run_ranks(tmp_path, _AGREE_WORKER.format(bindings=os.path.join(ROOT, "bindings", "python")))
    assert outs[1]["failed"] == "injected failure", outs
    assert "another rank's step() failed" in outs[0]["failed"], outs
    for out in outs:
        assert "1 of 2 ranks skipped this step" in out["skipped"], outs
