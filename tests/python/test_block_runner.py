"""The block runner on blocks people write (Note [Activation plans] in activations/runner.py): in-place ops after a split
matmul, nn.MultiheadAttention with masks, no hooks once every block is kept, auto under a small host budget."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from harness import Task, assert_bit_identical, torch_device, train
from test_plans import OPT_NONE, _find_split_plan

MODES = ["none", "host", "auto", "recompute"]  # every TIERFLOW_OFFLOAD_ACTIVATIONS


def _train_split(task: Task, device: str, steps: int = 3) -> tuple:
    """`steps` steps under the split plan (every block splits half its rows), as test_plans does: the losses,
    the final state and the session (alive while the caller holds it)."""
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations="recompute", **OPT_NONE)
    losses = []
    for step in range(steps):
        loss = task.loss(model, task.batch_on(step, device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:  # the first forward recorded each block's table
            _find_split_plan(tierflow.current_session())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, tierflow.current_session()


# ---- in-place ops on a split matmul's output --------------------------------------------------------------------


class InPlaceBlock(nn.Module):
    """Linears whose outputs are written in place before something saves them, and one that is not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.c = nn.Linear(32, 64)
        self.d = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)
        self.drop = nn.Dropout(0.2, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x.transpose(0, 1)).transpose(0, 1))  # F.linear with bias on a non-contiguous input
        g = self.drop(self.a(x))                                    # Dropout(inplace=True) on addmm's output
        m = self.d(x)
        m.mul_(2.0)                                                  # mul_ on addmm's output
        return x + self.b(h * g * torch.sigmoid(m) * F.gelu(self.c(x)))  # gelu saves c's output: split


def inplace_task() -> Task:
    def make():
        return nn.Sequential(nn.Sequential(InPlaceBlock(), InPlaceBlock()), nn.Linear(32, 4))

    def batch(i: int) -> tuple:
        g = torch.Generator().manual_seed(5000 + i)
        return torch.randn(16, 8, 32, generator=g), torch.randint(0, 4, (16, 8), generator=g)

    return Task(make, batch, lambda m, b: F.cross_entropy(m(b[0]).reshape(-1, 4), b[1].reshape(-1)))


def test_inplace_ops_after_a_split_matmul_are_not_applied_twice(device):
    # The replay writes a split matmul's swapped rows back and then runs the ops after it; rows written in
    # place since the matmul (bias add_, dropout's mask, mul_) would get that op twice. Such a matmul is rerun
    # whole; the others still split.
    task = inplace_task()
    base = train(task, 3, False, device=device)
    losses, params, session = _train_split(task, device)
    assert losses == base.losses
    for k, v in params.items():
        assert torch.equal(v, base.params[k]), k
    plan = session.report()["plan"]
    assert plan["split_rows"] > 0
    table = session.planner.runners[0].table
    assert table.mutated_ops and not (table.mutated_ops & table.split_ops)


# ---- nn.MultiheadAttention with masks -------------------------------------------------------------------------


class MHAModel(nn.Module):
    """Plain nn.MultiheadAttention modules as the blocks, called as self-attention (query is key is value)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True) for _ in range(2)])
        self.out = nn.Linear(32, 4)

    def forward(self, x, key_padding_mask, attn_mask):
        for b in self.blocks:
            x = x + b(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask)[0]
        return self.out(x)


def mha_task(mask: str) -> Task:
    def batch(i: int) -> tuple:
        g = torch.Generator().manual_seed(6000 + i)
        kpm = torch.zeros(4, 8, dtype=torch.bool)
        kpm[:, 6:] = True
        am = torch.ones(8, 8, dtype=torch.bool).triu(1)
        if mask == "float":
            kpm = torch.zeros(4, 8).masked_fill(kpm, float("-inf"))
            am = torch.zeros(8, 8).masked_fill(am, float("-inf"))
        return torch.randn(4, 8, 32, generator=g), kpm, am, torch.randint(0, 4, (4, 8), generator=g)

    return Task(MHAModel, batch, lambda m, b: F.cross_entropy(m(b[0], b[1], b[2]).reshape(-1, 4), b[3].reshape(-1)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask", ["bool", "float"])
def test_multihead_attention_with_masks_matches_the_baseline(device, mode, mask):
    # The replay must pass one tensor where the forward got one tensor three times: MultiheadAttention
    # takes its self-attention path (one packed projection) only when query is key is value.
    task = mha_task(mask)
    base = train(task, 3, False, device=device)
    tier = train(task, 3, True, device=device, offload_activations=mode, **OPT_NONE)
    assert_bit_identical(base, tier)
    if mode == "recompute":
        assert tier.report["plan"]["replays"] == 3 * 2


# ---- no hooks once every block is kept ---------------------------------------------------------------------------


def test_a_plan_that_keeps_everything_leaves_no_hook_and_eval_keeps_the_fast_path(device):
    # nn.TransformerEncoderLayer leaves its inference fast path when a module hook is attached; eval outputs
    # then differ from the baseline's in the last bits, and inference is slower.
    dev = torch_device(device)

    def make():
        layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), nn.Linear(64, 8))

    def batch(i):
        g = torch.Generator().manual_seed(7000 + i)
        return torch.randn(8, 32, 64, generator=g).to(dev), torch.randint(0, 8, (8, 32), generator=g).to(dev)

    def run(use_tierflow: bool):
        torch.manual_seed(0)
        model = make().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if use_tierflow:
            model, opt = tierflow.wrap(model, opt, device=device, **OPT_NONE)  # auto; everything fits
        for step in range(4):
            x, y = batch(step)
            F.cross_entropy(model(x).reshape(-1, 8), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            out = model(batch(99)[0])
        return model, out

    base_model, base_out = run(False)
    model, out = run(True)
    assert tierflow.report()["plan"]["modes"] == ["keep", "keep"]
    for layer in model[0].layers:
        assert not layer._forward_hooks and not layer._forward_pre_hooks
    assert torch.equal(out, base_out)


# ---- auto under a small host budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["none", "host"])
def test_auto_trains_under_a_16_mib_host_budget(device, optimizer):
    # The link probe, before the third forward, took two 32 MiB pinned buffers from a 16 MiB pool.
    from harness import gpt_task

    budget = 16 << 20
    task = gpt_task()
    settings = dict(OPT_NONE, offload_optimizer=optimizer)
    base = train(task, 4, False, device=device)
    tier = train(task, 4, True, device=device, host_memory="16MiB", **settings)
    if optimizer == "none":
        assert_bit_identical(base, tier)
    assert tier.report["plan"]["modes"] and "profiling" not in tier.report["plan"]["summary"]
    pool = tier.report["host_pool"]
    assert pool["reserved"]["peak"] <= budget, pool
    assert tier.report["activations"]["host_bytes"]["peak"] <= budget
    from tierflow._links import probe_bytes

    assert probe_bytes(tierflow.current_session().runtime) <= budget // 16


# ---- attention that draws from the generator ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                                  "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu"])
def test_attention_with_dropout_is_rerun_not_restored(name):
    # Flash/efficient attention with dropout advance the CUDA generator's Philox offset: a split replay that
    # restored their outputs would skip that draw and every later dropout mask of the block would differ (GPU
    # only: the CPU kernels refuse dropout, so this checks the rule; the [cuda] GPT-2 cases in test_hf_models.py
    # and test_model_zoo.py check the result).
    from tierflow.activations.table import attention_dropout

    func = getattr(torch.ops.aten, name).default
    names = [a.name for a in func._schema.arguments]
    k = names.index("dropout_p")
    q = torch.empty(1)
    positional = [q] * k + [0.1]
    assert attention_dropout(func, tuple(positional), {}) == pytest.approx(0.1)
    assert attention_dropout(func, (q, q, q), {"dropout_p": 0.25}) == pytest.approx(0.25)
    assert attention_dropout(func, tuple([q] * k + [0.0]), {}) == 0.0
    assert attention_dropout(func, (q, q, q), {}) == 0.0  # the schema's default
