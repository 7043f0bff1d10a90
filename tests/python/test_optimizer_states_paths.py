"""Optimizer state formats (TIERFLOW_OPTIMIZER_STATES: Note [Optimizer state formats]) everywhere the states go:
the step during backward (Note [Step during backward]), the NVMe tier (Note [Optimizer states on NVMe]), the
GPU share (Note [GPU optimizer share]) and partitioned or sharded data parallelism.

Each path is compared with the host path of the same format, bit for bit: every path runs the same kernel on the
same gradients and the same stored moments, so a format that is lost, mis-sized or re-quantized on the way
shows up as a different weight. The host path itself is tested against a scalar reference in
tests/cpp/test_state_format.cpp and against fp32 with rounding in test_optimizer_states.py.
"""

import os
import textwrap

import pytest
import torch

from harness import assert_bit_identical, gpt_task, train
from ranks import GLOO, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL = "4KiB"  # many buckets even for the small test GPT
PACKED = ["bf16", "8bit"]


def _moments(opt):
    """{(group index, param index): (exp_avg, exp_avg_sq)} of a CPUAdamW, as its state_dict holds them."""
    def pair(s):
        if "exp_avg_codes" in s:  # 8-bit (Note [Optimizer states in checkpoints]): codes and scales
            return tuple(torch.cat([s[n + "_codes"].reshape(-1), s[n + "_absmax"].view(torch.uint8)])
                         for n in ("exp_avg", "exp_avg_sq"))
        return s["exp_avg"].clone(), s["exp_avg_sq"].clone()
    return {k: pair(s) for k, s in opt.state_dict()["state"].items()}


# -- the step during backward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", PACKED)
def test_streamed_steps_with_packed_moments_equal_steps_after_backward(fmt, device):
    """Early steps committed: the out-of-place moments are the format's (same dtype and bytes), so the committed
    state is the one a step after backward leaves."""
    task = gpt_task(dropout=0.0)
    streamed = train(task, 3, True, device=device, grad_bucket_bytes=SMALL, optimizer_states=fmt)
    after = train(task, 3, True, device=device, overlap_step="off", optimizer_states=fmt)
    assert_bit_identical(streamed, after)
    s = streamed.report["optimizer"]["streaming"]
    assert s["committed"] == s["early_steps"] > 0 and s["redone"] == 0 and s["taken_back"] == 0
    assert streamed.host_in_use_after_release == 0


@pytest.mark.parametrize("fmt", PACKED)
def test_taken_back_and_redone_packed_steps_restart_from_the_same_quantized_state(fmt, device):
    """A wrong accumulation hint takes early steps back (accumulation: every micro-batch but the last streams
    for nothing); a binding clip redoes them from the landed gradients. Both restart from the stored moments,
    which the discarded out-of-place results never touched: bit for bit the step after backward."""
    task = gpt_task(dropout=0.0)
    hinted = train(task, 3, True, device=device, accumulate=3, grad_accumulation_steps=1, grad_bucket_bytes=SMALL,
                   optimizer_states=fmt)
    assert_bit_identical(hinted, train(task, 3, True, device=device, accumulate=3, overlap_step="off",
                                       optimizer_states=fmt))
    s = hinted.report["optimizer"]["streaming"]
    assert s["taken_back"] > 0, s
    # 1.0: the running norm crosses the bound after some buckets stepped early (0.6 stops before any)
    clipped = train(task, 3, True, device=device, max_grad_norm=1.0, grad_bucket_bytes=SMALL, optimizer_states=fmt)
    assert_bit_identical(clipped, train(task, 3, True, device=device, clip_grad_norm=1.0, overlap_step="off",
                                        optimizer_states=fmt))
    s = clipped.report["optimizer"]["streaming"]
    assert s["redone"] > 0 and s["committed"] == 0, s


# -- the GPU share -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", PACKED)
def test_a_parameter_moving_into_the_gpu_share_takes_its_moments_decoded_to_fp32(fmt):
    """The share keeps fp32 moments (gpu_share.py's module doc): a host state in bf16 or 8bit moving into it
    (GpuShare.choose) arrives decoded, shaped like its parameter; the master and step as they were."""
    from tierflow import _C
    from tierflow.optim.gpu_share import _device_copies
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 300))  # several 8-bit blocks, the last one partial
    m, v = _C.encode_moments(fmt, torch.randn(900) * 1e-2, torch.rand(900) * 1e-4)
    state = {"step": torch.tensor(2.0), "exp_avg": m, "exp_avg_sq": v, "master": p.detach().clone()}
    moved = _device_copies(p, state)
    want_m, want_v = _C.decode_moments(m, v, 900)
    for name, want in (("exp_avg", want_m), ("exp_avg_sq", want_v)):
        assert moved[name].dtype == torch.float32 and moved[name].shape == p.shape, name
        assert torch.equal(moved[name].reshape(-1), want.reshape(-1)), name
    assert torch.equal(moved["master"], p.detach())


# -- the NVMe tier -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", PACKED)
def test_packed_states_on_nvme_equal_the_host_tier_and_move_their_own_bytes(fmt, nvme_dir, device):
    """TIERFLOW_OFFLOAD_OPTIMIZER=nvme keeps the moments in their format (Note [Optimizer states on NVMe]): bit for
    bit the host tier's run of that format, reading and writing the fp32 master plus moment_bytes per moment a
    step (8bit: about 6 bytes a parameter, not 12); the masters its state_dict reads back are the host tier's."""
    from tierflow import _C
    task = gpt_task(dropout=0.0)
    steps = 3
    nvme = train(task, steps, True, device=device, offload_optimizer="nvme", nvme_paths=nvme_dir,
                 nvme_memory="64MiB", optimizer_states=fmt, dtype=torch.bfloat16)
    host = train(task, steps, True, device=device, optimizer_states=fmt, dtype=torch.bfloat16)
    assert_bit_identical(nvme, host)
    assert nvme.masters.keys() == host.masters.keys() and nvme.masters
    for k in host.masters:
        assert torch.equal(nvme.masters[k], host.masters[k]), k
    torch.manual_seed(0)
    numels = [p.numel() for p in task.model_on(device).parameters()]
    per_step = sum(_C.nvme_optimizer_state_bytes(n, False, fmt) for n in numels)
    assert per_step < (0.55 if fmt == "8bit" else 0.7) * sum(12 * n for n in numels)
    # Each step reads and writes every state once (the state_dict's reads are not a step's).
    assert nvme.nvme_adam["bytes_written"] == nvme.nvme_adam["bytes_read"] == steps * per_step


# -- partitioned DDP and FSDP2's shards (gloo ranks) -------------------------------------------------------------

_RANKS_WORKER = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.fsdp import fully_shard
    sys.path[:0] = [{bindings!r}]
    import tierflow
    from tierflow import _C

    rank, store, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (run_ranks ends the rest)
    torch.set_num_threads(1)

    def mlp():
        return nn.Sequential(nn.Linear(16, 300), nn.GELU(), nn.Linear(300, 64), nn.LayerNorm(64), nn.Linear(64, 4))

    def steps(net, opt, n=3):
        losses = []
        for step in range(n):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def states(opt):
        # (dtype, numel) of each state's exp_avg, with the numel of its parameter's local shard
        out = []
        for p, s in opt.state.items():
            local = p.to_local() if hasattr(p, "to_local") else p
            out.append((str(s["exp_avg"].dtype), s["exp_avg"].numel(), local.numel()))
        return out

    out = {{}}
    for fmt in ("bf16", "8bit"):
        for partition in ("on", "off"):
            torch.manual_seed(0)
            model = mlp()
            net, opt = tierflow.wrap(DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-2), device="emulated",
                                     offload_activations="none", partition_optimizer=partition, cpu_threads=1,
                                     optimizer_states=fmt)
            losses = steps(net, opt)
            out[("ddp", fmt, partition)] = dict(losses=losses, states=states(opt),
                                                params={{k: v.detach().clone() for k, v in model.state_dict().items()}})
            tierflow.unwrap(net)
        for overlap in ("on", "off"):
            torch.manual_seed(0)
            model = mlp()
            for i in (0, 2, 4):
                fully_shard(model[i])
            fully_shard(model)
            net, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="emulated",
                                     offload_activations="none", cpu_threads=1, optimizer_states=fmt,
                                     overlap_step=overlap)
            losses = steps(net, opt)
            out[("fsdp2", fmt, overlap)] = dict(
                losses=losses, states=states(opt), overlap=dict(opt.overlap_stats),
                params={{n: p.to_local().detach().clone() for n, p in model.named_parameters()}})
            tierflow.unwrap(net)
    torch.save(out, out_path)
    dist.barrier()
    os._exit(0)  # torch's gloo may abort at exit after broadcasts (test_distributed.py)
""")


@GLOO
@pytest.mark.ordering
def test_partitioned_ddp_and_fsdp2_shards_keep_packed_states_per_rank(tmp_path):
    """Two gloo ranks. Partitioned DDP (each parameter's state on one rank): bit for bit the unpartitioned
    optimizer, which steps every parameter on every rank from the same reduced gradient, with the format's
    moments. FSDP2: each rank keeps its shard's moments in the format, its 8-bit blocks counted from the shard's
    first element (a buffer of moment_bytes of the shard, not of the parameter), and the shards stepped during
    backward are bit for bit those step() steps."""
    from tierflow import _C
    outs = run_ranks(tmp_path, _RANKS_WORKER.format(bindings=os.path.join(ROOT, "bindings", "python")))
    dtype = {"bf16": "torch.bfloat16", "8bit": "torch.uint8"}
    for rank, out in enumerate(outs):
        for fmt in PACKED:
            on, off = out[("ddp", fmt, "on")], out[("ddp", fmt, "off")]
            assert on["losses"] == off["losses"], (rank, fmt)
            for k, v in off["params"].items():
                assert torch.equal(on["params"][k], v), (rank, fmt, k)
                assert torch.equal(outs[0][("ddp", fmt, "on")]["params"][k], v), (rank, fmt, k)
            assert 0 < len(on["states"]) < len(off["states"]) == 8, (rank, fmt)
            fs, fs_off = out[("fsdp2", fmt, "on")], out[("fsdp2", fmt, "off")]
            assert fs["losses"] == fs_off["losses"], (rank, fmt)
            for k, v in fs_off["params"].items():
                assert torch.equal(fs["params"][k], v), (rank, fmt, k)
            assert fs["overlap"]["committed"] > 0 and fs_off["overlap"]["early_steps"] == 0, (rank, fmt)
            for states in (on["states"], off["states"], fs["states"]):
                for kind, numel, local in states:
                    assert kind == dtype[fmt], (rank, fmt, kind)
                    assert numel == (_C.moment_bytes("8bit", local) if fmt == "8bit" else local), (rank, fmt)
    # FSDP2 sharded each parameter: the ranks' shards of the 300-row layer are half of it
    assert {n for _, _, n in outs[0][("fsdp2", "8bit", "on")]["states"]} != \
        {n for _, _, n in outs[0][("ddp", "8bit", "off")]["states"]}
