"""Gradients known by their content (Note [Gradient content] in optimizer/grad_content.hpp).

A step taken during backward is committed only if the gradient step() would step has the bytes that streamed:
writes that move no version counter (p.grad.data.clamp_(), dist.all_reduce(p.grad), an edit through .data)
are changes all the same. Each case is compared with plain torch (within the CPU AdamW's rounding) and, bit for
bit, with tierflow stepping after backward (TIERFLOW_OVERLAP_STEP=off: the same kernel on p.grad as the user
left it).
"""

import pytest
import torch

import tierflow
from harness import assert_bit_identical, assert_close, gpt_task, train

SMALL = "4KiB"  # many buckets: most gradients stream and step early


def clamp_by_data(model):
    """The old tutorial idiom: an in-place edit through .data moves no version counter."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.clamp_(-1e-3, 1e-3)


def all_reduce_by_hand(model):
    """What a hand-written data-parallel loop's all_reduce(p.grad) then a pre-divided loss leave: other values in
    the same tensor at the same version (here one rank's view: the average of its gradient and a constant)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.add_(1e-3).mul_(0.5)


def one_element(model):
    """The smallest change there is: one element of one gradient, by one unit in the last place."""
    p = next(p for p in model.parameters() if p.grad is not None and p.grad.numel() > 1)
    bits = p.grad.data.view(-1).view(torch.int16 if p.grad.element_size() == 2 else torch.int32)
    bits[p.grad.numel() // 2] += 1


def negate_by_data(model):
    """p.grad.data.neg_(): every bit pattern moves by the sign bit alone."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.neg_()


def not_contiguous(model):
    """The same values in a gradient of other strides (torch's AdamW takes it): not known, so stepped again."""
    for p in model.parameters():
        if p.grad is not None and p.grad.dim() == 2:
            p.grad = p.grad.t().contiguous().t()


@pytest.mark.parametrize("edit", [clamp_by_data, all_reduce_by_hand, one_element, negate_by_data, not_contiguous])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_changed_without_its_version_is_stepped_as_changed(edit, dtype, device):
    task = gpt_task(dropout=0.0)
    tier = train(task, 3, True, device=device, dtype=dtype, before_step=edit, grad_bucket_bytes=SMALL)
    assert_bit_identical(tier, train(task, 3, True, device=device, dtype=dtype, before_step=edit,
                                     overlap_step="off"))
    if dtype == torch.float32:
        assert_close(train(task, 3, False, device=device, dtype=dtype, before_step=edit), tier)
    s = tier.report["optimizer"]["streaming"]
    assert s["early_steps"] > 0, "the gradients streamed and stepped early: the check had something to refuse"
    if edit in (one_element, not_contiguous):
        assert s["taken_back"] >= 3 and s["committed"] == s["early_steps"] - s["taken_back"]
    else:
        assert s["committed"] == 0, "every early step was taken from a gradient that changed afterwards"


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_an_edit_before_or_after_the_users_clip_is_seen(max_norm, device):
    """Note [Clip picked up] keeps the early steps across the user's clip_grad_norm_; an edit through .data
    before the clip (not a candidate) or after it (not the clip's bytes) is stepped from p.grad."""
    task = gpt_task(dropout=0.0)
    for edit in (clamp_by_data, one_element):
        tier = train(task, 3, True, device=device, clip_grad_norm=max_norm, before_step=edit, grad_bucket_bytes=SMALL)
        assert_bit_identical(tier, train(task, 3, True, device=device, clip_grad_norm=max_norm, before_step=edit,
                                         overlap_step="off"))
    # Edited before the clip: a gradient hook of the user's that edits through .data, after the stream's copy.
    base = train(task, 3, False, device=device, clip_grad_norm=max_norm, before_step=None)
    tier = train(task, 3, True, device=device, clip_grad_norm=max_norm, grad_bucket_bytes=SMALL)
    assert_close(base, tier)
    s = tier.report["optimizer"]["streaming"]
    assert s["content_check_ms"] >= 0 and s["clips_picked_up"] > 0, "unedited gradients are still picked up"


def test_unedited_gradients_still_commit_every_early_step(device):
    """The check costs no early step that was right: every one commits when nothing changed."""
    tier = train(gpt_task(dropout=0.0), 3, True, device=device, grad_bucket_bytes=SMALL)
    s = tier.report["optimizer"]["streaming"]
    assert s["committed"] == s["early_steps"] > 0 and s["taken_back"] == 0


SIZES = [0, 1, 4095, 4096, 4097, 3 * 4096 + 17]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_device_computation_gives_the_hosts_pair(dtype):
    """A GPU's kernel (slab sums, added on the host) and the host's one pass agree on every size, negative bit
    patterns included; a change of one bit, a swap of two elements or a negation changes the pair."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    g = torch.Generator().manual_seed(0)
    for n in SIZES:
        t = (torch.randn(n, generator=g) * 1e3).to(dtype)
        host = tierflow._C._grad_content(t)
        assert host[2] is True
        for d in devices:
            assert tierflow._C._grad_content(t.to(d)) == host, (n, d)
        if n > 1:
            u = t.clone()
            u.view(torch.int16 if u.element_size() == 2 else torch.int32)[n - 1] ^= 1
            assert tierflow._C._grad_content(u) != host
            w = t.clone()
            w[0], w[n - 1] = t[n - 1], t[0]
            if not torch.equal(w, t):
                assert tierflow._C._grad_content(w) != host
    # p.grad.data.neg_() where the signs run +, -, -, + (what linear position weights could not see).
    t = torch.tensor([0.5, -0.25, -2.0, 1.5], dtype=dtype)
    assert tierflow._C._grad_content(t) != tierflow._C._grad_content(-t)
    # Not contiguous, or not a kernel's dtype: not known (counts as changed).
    assert tierflow._C._grad_content(torch.zeros(4, 4).t())[2] is False
    assert tierflow._C._grad_content(torch.zeros(4, dtype=torch.float64))[2] is False
