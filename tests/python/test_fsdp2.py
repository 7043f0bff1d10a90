"""FSDP2 under tierflow (Note [Distributed training] in bindings/python/tierflow/_distributed.py).

FSDP2 (torch.distributed.fsdp.fully_shard): two gloo processes train a small transformer-like model whose blocks
and root are FSDP2 units, with and without tierflow, in both orders (wrap after fully_shard, fully_shard after
wrap), activations kept, swapped to the host, recomputed, and planned (auto, with room and under a tight budget),
the user's optimizer stepping FSDP2's shards (bit-identical to FSDP2 alone on each rank) or tierflow's CPU AdamW
stepping each rank's shard (during backward; within its rounding; each rank holds its shard's states only, in
memory or on NVMe); transformers' GPT-2 with its default config alike; checkpoints through
torch.distributed.checkpoint resume bit for bit. What FSDP2's shards do not take yet (offloaded gradients, the
GPU share, parameter offload, a CPU
optimizer over a partly sharded model or made before fully_shard) is refused with an error that names it and
says what FSDP2 accepts (a process group of one process; fully_shard runs on the CPU with gloo).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
import torch.nn as nn

import tierflow
from harness import Run, assert_close
from ranks import GLOO, mlp, module_hooks, run_ranks, train_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [GLOO, pytest.mark.ordering]  # the ranks train in children (Note [Test tiers])


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
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (run_ranks ends the rest)
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

    def run(order, acts=None, budget=None, optimizer="none", clip=None, scale=None, **more):
        torch.manual_seed(0)
        model = Net()
        settings = dict(device="emulated", offload_activations=acts, offload_optimizer=optimizer,
                        min_offload_bytes=0, prefetch_bytes="64KiB", cpu_threads=1, **more)
        if acts == "auto tight":
            settings.update(offload_activations="auto", gpu_memory=str(budget))
        # What FSDP2 gathers per unit, from the unsharded model: each block's parameter bytes, the root's.
        units = ([sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks],
                 sum(p.numel() * p.element_size() for m in (model.inp, model.out) for p in m.parameters()))
        if order == "fully_shard(wrap)":  # wrap first: tierflow finds FSDP2 at the first forward
            settings.pop("offload_optimizer")  # no optimizer to replace: the default's CPU optimizer is not made
            model, _ = tierflow.wrap(model, None, **settings)
        shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)  # steps FSDP2's shards
        if order == "wrap(fully_shard)":
            model, opt = tierflow.wrap(model, opt, **settings)
        out = dict(losses=[], units=units)
        for step in range(FSDP_STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
            x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if clip is not None:  # the user's clip, over every rank's shards (it binds at 0.3 here)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scale is not None:  # a foreach multiply of DTensor gradients moves no version counter
                torch._foreach_mul_([p.grad for p in model.parameters()], scale)
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
        out["shards"] = {{n: p.to_local().detach().clone() for n, p in model.named_parameters()}}
        out["numel"] = sum(p.numel() for p in model.parameters())  # all ranks' shards together
        if isinstance(opt, tierflow.CPUAdamW):  # what this rank holds of the states: its shards' only
            saved = opt.state_dict()["state"]  # NVMe states read back; each a DTensor of this rank's shard
            out["state_numel"] = {{k: sum(s[k].to_local().numel() for s in saved.values())
                                  for k in ("exp_avg", "exp_avg_sq")}}
            out["master_numel"] = sum(s["master"].numel() for s in opt.state.values() if "master" in s)
            out["off"] = tierflow.report()["optimizer"].get("steps_during_backward_off")
            out["overlap"] = dict(opt.overlap_stats)
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
    NVME = os.path.join(os.path.dirname(store), "nvme")  # both ranks' swap files, named by rank
    os.makedirs(NVME, exist_ok=True)
    nvme = dict(nvme_paths=NVME, nvme_memory="256MiB")
    for acts in {cpu_acts}:  # tierflow's CPU AdamW stepping each rank's shard, its states in memory or on NVMe
        results[("wrap(fully_shard)", acts, "host")] = run("wrap(fully_shard)", acts, optimizer="host")
        results[("wrap(fully_shard)", acts, "nvme")] = run("wrap(fully_shard)", acts, optimizer="nvme", **nvme)
    # The shards' steps during backward against step()'s, and under a clip (the user's, and tierflow's own).
    results["step() only"] = run("wrap(fully_shard)", "none", optimizer="host", overlap_step="off")
    results["baseline clipped"] = run(None, clip=0.3)
    results["user clip"] = run("wrap(fully_shard)", "none", optimizer="host", clip=0.3)
    results["tierflow clip"] = run("wrap(fully_shard)", "none", optimizer="host", max_grad_norm=0.3)
    results["scaled"] = run("wrap(fully_shard)", "none", optimizer="host", scale=0.5)
    for name, kw in (("user clip", dict(clip=0.3)), ("tierflow clip", dict(max_grad_norm=0.3)),
                     ("scaled", dict(scale=0.5))):
        results[name + ", step() only"] = run("wrap(fully_shard)", "none", optimizer="host", overlap_step="off", **kw)

    def checkpointed(optimizer, dtype=torch.float32, states="fp32"):
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
                                 cpu_threads=1, **(nvme if optimizer == "nvme" else {{}}),
                                 **({{}} if optimizer == "none" else dict(optimizer_states=states)))

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

        path = os.path.join(os.path.dirname(store), f"dcp-{{optimizer}}-{{dtype}}-{{states}}")
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

    for optimizer in ("none", "host", "nvme"):
        results[("checkpoint", optimizer)] = checkpointed(optimizer)
    results[("checkpoint", "host", "bf16")] = checkpointed("host", torch.bfloat16)
    # 8-bit moments (Note [Optimizer states in checkpoints]): out as decoded fp32 DTensors, encoded again on load
    results[("checkpoint", "host", "bf16", "8bit")] = checkpointed("host", torch.bfloat16, "8bit")
    results[("checkpoint", "nvme", "fp32", "8bit")] = checkpointed("nvme", torch.float32, "8bit")

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
    return run_ranks(d, script)


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


@pytest.mark.parametrize("order", FSDP_ORDERS)
def test_fsdp2_auto_budgets_each_ranks_shards_and_fsdp2s_gathered_copies(fsdp_runs, order):
    """`auto` under FSDP2 counts what each rank holds: its shards of the parameters, their gradients and (torch's
    AdamW on the device) their two moments, and FSDP2's gathered copies (tiering::fsdp_gathered_bytes: the root's
    for the whole step, and for four equal blocks a block's parameters and unsharded gradients beside both
    neighbours' in backward), whether FSDP2 came before wrap or after it."""
    for rank, results in enumerate(fsdp_runs):
        run = results[(order, "auto")]
        blocks, root = run["units"]
        assert len(set(blocks)) == 1 and len(blocks) == 4, blocks
        gathered = root + 4 * blocks[0]
        assert run["plan"]["fsdp_gathered_bytes"] == gathered, (run["plan"]["fsdp_gathered_bytes"], gathered)
        shards = sum(t.numel() * t.element_size() for t in run["shards"].values())  # this rank's
        assert 2 * shards == run["numel"] * 4, (shards, run["numel"])  # half of every fp32 parameter
        # The emulated device measures no peak: the fixed bytes are what is counted (Note [Auto plan phases]):
        # the moments too where offload_optimizer="none" was set (fully_shard(wrap) leaves the default, "host").
        held = 4 * shards if order == "wrap(fully_shard)" else 2 * shards
        assert run["plan"]["timed_step"]["fixed_device_bytes"] == held + gathered, run["plan"]["timed_step"]
    base = fsdp_runs[0]["baseline"]
    assert base["units"] == fsdp_runs[0][(order, "auto")]["units"]


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
@pytest.mark.parametrize("acts", FSDP_CPU_ACTS)
def test_fsdp2_with_the_cpu_optimizer_steps_each_ranks_shard(fsdp_runs, acts, optimizer):
    """tierflow's CPU AdamW under FSDP2 (ZeRO-Offload's design on FSDP2's shards), its states in host memory or
    on NVMe (each rank's in its own swap files): FSDP2's results within the CPU AdamW's rounding, and each rank
    holds the states of its own shard only: one copy of them on the node."""
    for rank, results in enumerate(fsdp_runs):
        base, run = results["baseline"], results[("wrap(fully_shard)", acts, optimizer)]
        assert_close(Run(losses=base["losses"], params=base["shards"]), Run(losses=run["losses"], params=run["shards"]))
        shards = sum(t.numel() for t in run["shards"].values())
        assert run["state_numel"] == {"exp_avg": shards, "exp_avg_sq": shards}, run["state_numel"]
        assert run["master_numel"] == (shards if optimizer == "host" else 0), run["master_numel"]  # NVMe: there
        if optimizer == "nvme":  # states on NVMe step in step() (Note [Optimizer states on NVMe])
            assert run["overlap"]["early_steps"] == 0, run["overlap"]
            continue
        # Each shard steps during backward from its reduce-scattered gradient, and step() commits every one.
        assert run["off"] is None, run["off"]
        assert run["overlap"]["early_steps"] == run["overlap"]["committed"] == FSDP_STEPS * len(run["shards"]), \
            run["overlap"]
    total = fsdp_runs[0][("wrap(fully_shard)", acts, optimizer)]["numel"]
    held = [results[("wrap(fully_shard)", acts, optimizer)]["state_numel"]["exp_avg"] for results in fsdp_runs]
    assert sum(held) == total and all(0 < h < total for h in held), (held, total)


def test_fsdp2_shards_step_during_backward_bit_for_bit_as_in_step(fsdp_runs):
    """Note [Distributed training]: each unit's reduce-scattered gradients feed the stream as FSDP2 assigns them
    (tierflow._fsdp_feed); the shards stepped during backward are bit for bit those step() steps
    (overlap_step="off"), on each rank."""
    for rank, results in enumerate(fsdp_runs):
        on, off = results[("wrap(fully_shard)", "none", "host")], results["step() only"]
        assert on["losses"] == off["losses"], (rank, on["losses"], off["losses"])
        for name, shard in off["shards"].items():
            assert torch.equal(on["shards"][name], shard), (rank, name)
        assert off["overlap"]["early_steps"] == 0, off["overlap"]


@pytest.mark.parametrize("change", ["user clip", "tierflow clip", "scaled"])
def test_fsdp2_gradients_changed_after_backward_step_as_in_step(fsdp_runs, change):
    """Gradients changed between backward and step(): torch's clip_grad_norm_ over FSDP2's DTensor gradients,
    tierflow's max_grad_norm (its norm over every rank's shards), and a foreach multiply of them (a GradScaler's
    unscale does one), which on DTensors moves no version counter (tierflow._fsdp_feed's fingerprints see it).
    Bit for bit the shards stepped in step() alone (overlap_step="off"); a clip within the CPU AdamW's rounding
    of FSDP2 with torch's AdamW and the same clip; no early step is committed (the clip binds at every step)."""
    for rank, results in enumerate(fsdp_runs):
        run, alone = results[change], results[change + ", step() only"]
        assert run["losses"] == alone["losses"], (rank, run["losses"], alone["losses"])
        for name, shard in alone["shards"].items():
            assert torch.equal(run["shards"][name], shard), (rank, name)
        assert run["overlap"]["committed"] == 0, run["overlap"]
        if change != "tierflow clip":  # tierflow's own stops speculating once its clip must bind: none to redo
            assert run["overlap"]["early_steps"] == run["overlap"]["redone"] > 0, run["overlap"]
        if change != "scaled":
            base = results["baseline clipped"]
            assert_close(Run(losses=base["losses"], params=base["shards"]),
                         Run(losses=run["losses"], params=run["shards"]))
        unchanged = results[("wrap(fully_shard)", "none", "host")]
        assert run["losses"][1:] != unchanged["losses"][1:], "the change changed nothing"


@pytest.mark.parametrize("case", [("none",), ("host",), ("host", "bf16"), ("nvme",), ("host", "bf16", "8bit"),
                                  ("nvme", "fp32", "8bit")],
                         ids=["torch AdamW", "CPU AdamW", "CPU AdamW bf16", "CPU AdamW, NVMe states",
                              "CPU AdamW bf16, 8-bit moments", "CPU AdamW, 8-bit moments on NVMe"])
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
REFUSED_WITH_FSDP2 = [dict(offload_gradients="on"), dict(gpu_optimizer_fraction="0.5"),
                      dict(offload_optimizer="none", offload_params="host")]
REFUSED_SETTING = ["TIERFLOW_OFFLOAD_GRADIENTS='on'", "TIERFLOW_GPU_OPTIMIZER_FRACTION=0.5",
                   "TIERFLOW_OFFLOAD_PARAMS='host'"]


@pytest.mark.parametrize("settings,setting", list(zip(REFUSED_WITH_FSDP2, REFUSED_SETTING)),
                         ids=["offloaded gradients", "gpu share", "params"])
@pytest.mark.parametrize("sharded", ["blocks and root", "one block"])
def test_fsdp2_with_settings_it_cannot_train_is_refused_and_leaves_nothing(world_of_one, sharded, settings, setting,
                                                                          nvme_dir):
    """What FSDP2's shards do not take yet (gradients freed during backward, the GPU share) and parameter offload (which would move what FSDP2 gathers): refused at wrap, naming the setting and what FSDP2
    accepts; nothing left behind."""
    settings = {k: ([nvme_dir] if v == NVME else v) for k, v in settings.items()}
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    if sharded == "blocks and root":
        for i in (0, 2, 4):
            fully_shard(model[i])
        fully_shard(model)
    else:
        fully_shard(model[2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = module_hooks(model)
    with pytest.raises(tierflow.TierflowError, match=r"fully_shard \(FSDP2\)") as refused:
        tierflow.wrap(model, opt, device="emulated", **settings)
    message = str(refused.value)
    assert setting in message and "accepted with FSDP2: TIERFLOW_OFFLOAD_OPTIMIZER=host" in message, message
    # Nothing left behind: no session, no hook, the optimizer as it was; FSDP2 trains on.
    assert getattr(model, "_tierflow_session", None) is None
    assert module_hooks(model) == hooks
    assert type(opt) is torch.optim.AdamW and opt.state == {}
    losses = train_steps(model, opt)
    assert all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.parametrize("settings", [dict(), dict(offload_activations="none")], ids=["defaults", "no activations"])
def test_fully_shard_after_wrap_with_the_cpu_optimizer_is_refused_at_the_first_forward(world_of_one, settings):
    """The CPU optimizer made at wrap holds the parameters from before fully_shard replaced them."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
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
    losses = train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert all(torch.isfinite(torch.tensor(losses))), losses


def test_the_cpu_optimizer_over_a_partly_sharded_model_is_refused(world_of_one):
    """fully_shard on one block only: its parameters are DTensor shards, the others plain, whose gradients FSDP2
    does not reduce; the CPU optimizer would step both kinds (and take one norm over both): refused, naming them."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model[2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = module_hooks(model)
    with pytest.raises(tierflow.ConfigError, match=r"2 of its 6 parameters are FSDP2's DTensor shards and 4 are not "
                                                   r"\('0.weight', '0.bias', '4.weight' and more\).*only partly "
                                                   r"under fully_shard"):
        tierflow.wrap(model, opt, device="emulated")
    assert getattr(model, "_tierflow_session", None) is None and module_hooks(model) == hooks
    assert type(opt) is torch.optim.AdamW


def _cpu_offloaded_mlp() -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = mlp()
    for i in (0, 2, 4):
        fully_shard(model[i], offload_policy=CPUOffloadPolicy(pin_memory=False))
    return fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))


def test_fsdp2_cpu_offload_policy_with_the_cpu_optimizer_is_refused_and_with_the_users_trains_as_alone(world_of_one):
    """FSDP2's CPUOffloadPolicy keeps the shards and their gradients on the host itself: tierflow's CPU AdamW beside
    it would own the same host copies, refused at wrap (naming it and what to do) with nothing left behind; the
    user's optimizer stepping FSDP2's host shards, with tierflow's activation offload, trains bit for bit as FSDP2
    alone."""
    model = _cpu_offloaded_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = module_hooks(model)
    with pytest.raises(tierflow.TierflowError, match=r"TIERFLOW_OFFLOAD_OPTIMIZER='host' beside FSDP2's shards "
                                                     r"kept in host memory \(fully_shard's "
                                                     r"offload_policy=CPUOffloadPolicy\).*TIERFLOW_OFFLOAD_OPTIMIZER=none"):
        tierflow.wrap(model, opt, device="emulated")
    assert getattr(model, "_tierflow_session", None) is None and module_hooks(model) == hooks
    assert type(opt) is torch.optim.AdamW and opt.state == {}

    alone = train_steps(model, opt, steps=3)
    model = _cpu_offloaded_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierflow.wrap(model, opt, device="emulated", offload_optimizer="none", offload_activations="host",
                               min_offload_bytes=0)
    try:
        assert type(opt) is torch.optim.AdamW
        assert train_steps(model, opt, steps=3) == alone
        assert tierflow.report()["activations"]["offloaded_blocks"] > 0
    finally:
        tierflow.unwrap(model)


def test_optimizer_holding_dtensor_parameters_is_refused(world_of_one):
    """An optimizer of another, sharded model: its DTensors are not the wrapped model's."""
    from torch.distributed.fsdp import fully_shard

    model, sharded = mlp(), fully_shard(mlp())
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    hooks = module_hooks(model)
    with pytest.raises(tierflow.TierflowError, match=r"6 of the optimizer's 6 parameters are DTensors.*"
                                                     r"the model has no FSDP2 module.*another model's"):
        tierflow.wrap(model, opt, device="emulated", offload_optimizer="none")
    assert getattr(model, "_tierflow_session", None) is None and module_hooks(model) == hooks


def test_dtensor_parameters_of_tensor_parallelism_are_refused(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = mlp()
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with pytest.raises(tierflow.TierflowError, match=r"4 of the model's parameters are DTensors \('0.weight'.*"
                                                     r"no module of it is an FSDP2 module.*tensor parallelism.*"
                                                     r"fully_shard \(FSDP2\) or DistributedDataParallel"):
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", offload_optimizer="none")
    assert getattr(model, "_tierflow_session", None) is None


def _feed_run(overlap: str, loop: str) -> tuple:
    """An FSDP2 model (each linear layer a unit; the model itself too unless `loop` says otherwise) trained 4
    steps by tierflow's CPU AdamW, with overlap_step `overlap`, in a training loop of kind `loop`."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for i in (0, 2, 4):
        fully_shard(model[i])
    if loop != "several roots, accumulation":  # else each unit is a root of its own (FSDP2 allows it)
        fully_shard(model)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="emulated",
                               offload_optimizer="host", offload_activations="none", cpu_threads=1,
                               grad_bucket_bytes="4KiB", overlap_step=overlap)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if loop == "GradScaler, unscale then clip" else None
    for step in range(4):
        micro = 2 if loop == "several roots, accumulation" else 1
        for m in range(micro):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + m))
            loss = model(x).square().mean()
            if loop == "a backward that raised" and step == 1:
                def boom(grad):
                    raise RuntimeError("boom")
                loss.register_hook(boom)
                with pytest.raises(RuntimeError, match="boom"):
                    loss.backward()
                opt.zero_grad()
                continue
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)  # a foreach op on FSDP2's DTensor gradients: no version counter moves
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # binds nowhere: a norm read
            scaler.step(opt)
            scaler.update()
        elif loop != "a backward that raised" or step != 1:
            opt.step()
        opt.zero_grad()
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    stats = dict(opt.overlap_stats)
    tierflow.unwrap(model)
    return shards, stats


@pytest.mark.parametrize("loop", ["several roots, accumulation", "GradScaler, unscale then clip",
                                  "a backward that raised"])
def test_fsdp2_feed_in_loops_that_change_gradients_or_fail_steps_as_in_step(world_of_one, loop):
    """Loops a review of the FSDP2 feed (tierflow._fsdp_feed) found wrong: several FSDP2 roots with gradient
    accumulation (a root reduces in its own final callback, after tierflow's, into the gradient fed from the
    backward before), a GradScaler's unscale before a clip (a change no version counter shows, then the clip's
    one that tierflow marks), a backward that raised (the feed goes on at the next). Bit for bit the shards
    stepped in step() alone, and steps during backward happened (and committed where nothing changed)."""
    on, stats = _feed_run("on", loop)
    off, _ = _feed_run("off", loop)
    for name, shard in off.items():
        assert torch.equal(on[name], shard), (loop, name, stats)
    assert stats["early_steps"] > 0, stats
    if loop == "a backward that raised":
        assert stats["committed"] >= 3 * 6, stats  # the other three steps' six parameters each
    if loop == "GradScaler, unscale then clip":
        assert stats["committed"] == 0, stats  # every gradient was unscaled after it streamed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_feeds_fingerprint_sees_a_change_of_one_tiny_element(dtype):
    """tierflow._fsdp_feed's fingerprint is exact (the sum of the bit patterns): a change no version counter shows
    is found however small, where a float32 norm and sum round it away (1e-10 beside 1e-3 values)."""
    from tierflow._fsdp_feed import _fingerprint

    g = torch.full((1 << 20,), 1e-3, dtype=dtype)
    g[12345] = 1e-10
    before = _fingerprint(g)
    assert torch.equal(before, _fingerprint(g.clone()))
    g[12345] = 0.0
    assert not torch.equal(before, _fingerprint(g))
    if dtype == torch.float32:  # what the float fingerprint it replaced could not see
        assert torch.linalg.vector_norm(g) == torch.linalg.vector_norm(g.clone().index_fill_(0, torch.tensor([12345]),
                                                                                          1e-10))
