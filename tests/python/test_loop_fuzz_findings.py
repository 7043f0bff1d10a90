"""What the training-loop fuzzer found (tests/python/loop_fuzz.py, issue 37 part 4), one named test a cause.

Each test is the smallest loop the fuzzer shrank the finding to, written out by hand, against plain PyTorch on
the emulated device (both modes: marked ordering). A cause someone is fixing is a strict xfail naming who (and
is in loop_fuzz.KNOWN_CAUSES): when the fix lands the test passes, pytest reports it (XPASS, strict), and the
fixer removes the mark here and moves the cause to loop_fuzz.FIXED_CAUSES. The causes below were found
on the tree of 5631fb6 (the loops named in each test differed there) and fixed while the fuzzer was written:
90e32a0 (replays), 0278f52 (gradient content), max_grad_norm under offload_optimizer='none' refused at wrap.
Reproduce the fuzzer's own loop with ``python tests/python/loop_fuzz.py --seed N``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from loop_fuzz import Loop, check



def _mlp_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))


def _batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in range(n)]


def _train(model: nn.Module, opt, batches: list, before_step=None) -> list:
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---- recompute's replay and auto's profiling run a block's forward again ------------------------------------------


@pytest.mark.ordering  # emulated only: the fuzzer's loops are CPU models
@pytest.mark.parametrize("acts", ["recompute", "auto"])
def test_batchnorm_running_statistics_move_once_per_forward(acts):
    # fuzzer: Loop(seed=4, acts='recompute'), Loop(seed=1, acts='auto'): blocks.0.bn.running_mean differs.
    # A replay must not move the running statistics again, or the replay must be refused naming BatchNorm.
    loop = Loop(seed=4, acts=acts, steps=3)
    verdict = check(loop)
    assert verdict.ok, f"{loop.line()}: {verdict.cause}: {verdict.detail}"


@pytest.mark.ordering  # emulated only: the fuzzer's loops are CPU models
@pytest.mark.parametrize("acts", ["recompute", "auto"])
def test_a_forward_hook_fires_once_per_forward(acts):
    # fuzzer: Loop(seed=0, acts='auto', hook='modify'): the hook ran 5 times, 3 without tierflow;
    # Loop(seed=20, acts='recompute', hook='observe'): 6 times, 3 without.
    loop = Loop(seed=20, model="encoder", acts=acts, hook="observe", steps=3)  # no BatchNorm: the hook alone
    verdict = check(loop)
    assert verdict.ok, f"{loop.line()}: {verdict.cause}: {verdict.detail}"


# ---- a gradient changed after backward without a version bump ---------------------------------------------------


@pytest.mark.ordering  # emulated only: the fuzzer's loops are CPU models
@pytest.mark.parametrize("edit", ["data_scale", "data_allreduce", "manual_data_clip"])
def test_a_gradient_edited_through_data_steps_as_edited(edit):
    # fuzzer: Loop(seed=27, opt_offload='host', grad_edit='data_scale'): loss 2 differs (rel 5.7e-4);
    # Loop(seed=88, opt_offload='host', clip='manual_data', max_norm=0.05): a weight differs by 3.9e-4.
    # The same edits in place (p.grad.mul_, which bumps the version) match: the early step is redone.
    kw = dict(clip="manual_data", max_norm=0.05) if edit == "manual_data_clip" else dict(grad_edit=edit)
    loop = Loop(seed=27, opt_offload="host", steps=3, **kw)
    verdict = check(loop)
    assert verdict.ok, f"{loop.line()}: {verdict.cause}: {verdict.detail}"


@pytest.mark.ordering  # emulated only: the fuzzer's loops are CPU models
def test_grad_scaler_unscale_steps_the_unscaled_gradients():
    # fuzzer: Loop(seed=18, opt_offload='host', scaler='on'): a weight or a loss differs, from run to run (the
    # early step races the unscale). torch._amp_foreach_non_finite_check_and_unscale_ leaves _version alone.
    g = torch.ones(3)
    torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(1), torch.full((1,), 0.5))
    assert g._version == 0  # why no version check can see it: torch's op, not tierflow's
    model = _mlp_bn()
    batches = _batches(4)
    base_model = _mlp_bn()
    base_opt = torch.optim.AdamW(base_model.parameters(), lr=1e-3)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="emulated")
    for m, o in ((base_model, base_opt), (model, opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for x, y in batches:
            scaler.scale(F.cross_entropy(m(x), y)).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    for (k, a), b in zip(base_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=5e-5, msg=k)
    tierflow.unwrap(model)


# ---- offload_optimizer="none" and the settings only tierflow's optimizer reads ------------------------------------


@pytest.mark.ordering  # emulated only: the fuzzer's loops are CPU models
def test_max_grad_norm_with_offload_optimizer_none_clips_or_is_refused():
    # fuzzer: Loop(seed=115, clip='tierflow', max_norm=0.05): loss 1 differs; the step was not clipped.
    batches = _batches(3)
    base_model = _mlp_bn()
    base_opt = torch.optim.AdamW(base_model.parameters(), lr=1e-3)
    base = _train(base_model, base_opt, batches,
                  before_step=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    try:
        model = _mlp_bn()
        model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="emulated",
                                   offload_optimizer="none", max_grad_norm=0.05, offload_activations="none")
        ours = _train(model, opt, batches)
    except (tierflow.TierflowError, tierflow.ConfigError) as e:
        assert "TIERFLOW_MAX_GRAD_NORM" in str(e) or "max_grad_norm" in str(e), str(e)
        return
    assert ours == base, f"max_grad_norm=0.05 did not clip: {ours} vs {base}"
