"""The adversarial emulated device (Note [Adversarial emulated device]) catches
issue 8's class of bug, which the polite emulation hid: copies not ordered
after the compute stream that produced or still uses their memory."""

import math

import pytest
import torch

import tierflow
from harness import gpt_task

# Each test picks the emulated mode itself; as tests that copy they are in the ordering tier all the same.
pytestmark = pytest.mark.ordering

AGGRESSIVE = dict(min_offload_bytes=0, prefetch_bytes="256KiB")


def _train(mode: str, monkeypatch, ignore_order: bool, **settings) -> tuple:
    monkeypatch.setenv("TIERFLOW_EMULATED_DEVICE", mode)
    task = gpt_task()
    torch.manual_seed(0)
    model = task.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    faults = None
    if ignore_order is not None:
        faults = tierflow._C.CopyFaults()
        faults.ignore_stream_order = ignore_order
    model, opt = tierflow.wrap(model, opt, device="emulated", _copy_faults=faults, **AGGRESSIVE, **settings)
    losses = _steps(task, model, opt)
    report = tierflow.report()
    tierflow.unwrap(model)
    return losses, report


def _steps(task, model, opt) -> list:
    losses = []
    for i in range(3):
        loss = task.loss(model, task.make_batch(i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _baseline() -> list:
    task = gpt_task()
    torch.manual_seed(0)
    model = task.make_model()
    return _steps(task, model, torch.optim.AdamW(model.parameters(), lr=1e-3))


@pytest.mark.parametrize("settings", [dict(offload_optimizer="none"), dict(overlap_step="off"),
                                      dict(overlap_step="on")], ids=["acts", "acts+opt", "acts+opt+overlap"])
def test_unordered_copies_break_training_only_in_adversarial_mode(settings, monkeypatch):
    base = _baseline()
    # Issue 8's bug (copies that wait for no stream), on the polite device: it
    # goes unseen, as it did before the first GPU run.
    polite, _ = _train("polite", monkeypatch, True, **settings)
    assert polite[0] == base[0]
    assert all(math.isfinite(x) for x in polite)
    # The same bug on the adversarial device: the first update is already wrong.
    bad, report = _train("adversarial", monkeypatch, True, **settings)
    assert report["emulated"]["unordered_copies"] > 0
    assert bad[0] == base[0], "forward of step 1 does not depend on any copy"
    assert any(not math.isfinite(x) or abs(x - y) > 1e-3 for x, y in zip(bad[1:], base[1:])), (bad, base)
    # The fixed ordering on the adversarial device trains as the baseline does.
    good, report = _train("adversarial", monkeypatch, False, **settings)
    assert report["emulated"]["unordered_copies"] == 0
    assert report["emulated"]["delayed_copies"] > 0, "the copies really were late"
    for x, y in zip(good, base):
        assert abs(x - y) <= 1e-6 * abs(y), (good, base)  # CPU AdamW rounding, see harness.assert_close


def test_adversarial_run_leaves_no_late_write(monkeypatch):
    _, report = _train("adversarial", monkeypatch, None, overlap_step="on")
    emu = report["emulated"]
    assert emu["mode"] == "adversarial" and emu["poisoned_device_memory"]
    assert emu["device_late_writes"] == 0
    assert report["host_pool"]["late_writes"] == 0
