"""Issue 37, part 3: a step is all or nothing (Note [Atomic step] in optimizer/step_plan.hpp).

An error raised from step() leaves every weight and optimizer state as it was before the step (a retry is then
one step, equal to torch's), or the step completes; what runs after the commit (the gradient stream's link
probe) cannot fail it; and wrap refuses a host budget that cannot hold one step, naming the bytes needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tierflow
from tierflow import _C
from tierflow.optim import streaming as streaming_module

from harness import torch_device

STEPS = 4


def mlp(width: int = 64, layers: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def batch(i: int, width: int = 64) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(100 + i))


def loss_of(model: nn.Module, i: int, device: str) -> torch.Tensor:
    return model(batch(i).to(torch_device(device))).square().mean()


def torch_run(steps: int, device: str) -> nn.Module:
    """The baseline: the same model, data and AdamW, without tierflow."""
    model = mlp().to(torch_device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        loss_of(model, i, device).backward()
        opt.step()
        opt.zero_grad()
    return model


def snapshot(model: nn.Module, opt) -> dict:
    """Every weight and every state (exp_avg, exp_avg_sq, master, step) as CPU copies, bit for bit."""
    out = {f"w.{n}": p.detach().to("cpu").clone() for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"s{i}.{k}"] = v.detach().to("cpu").clone()
    return out


def assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys(), sorted(set(before) ^ set(after))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"a failed step changed {changed}"


def assert_same_as_torch(model: nn.Module, opt, expected: nn.Module, steps: int, exact: nn.Module = None) -> None:
    """Torch's weights (the CPU AdamW rounds as torch's to 1e-6: test_optimizer.py), the step counts of ``steps``
    steps, and, given ``exact``, a tierflow run that never failed, bit for bit (one step, not two)."""
    for (n, p), q in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-6, atol=1e-6, msg=n)
    if exact is not None:
        for (n, p), q in zip(model.named_parameters(), exact.parameters()):
            assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"{n} differs from a run that never failed"
    counts = {float(s["step"]) for s in opt.state.values()}
    assert counts == {float(steps)}, f"step counts {counts} after {steps} steps"


def tierflow_run(steps: int, device: str, **kw) -> nn.Module:
    """The same run under tierflow, with no failure."""
    model, opt = wrapped(device, **kw)
    for i in range(steps):
        loss_of(model, i, device).backward()
        opt.step()
        opt.zero_grad()
    return model


def wrapped(device: str, **kw):
    model = mlp().to(torch_device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierflow.wrap(model, opt, device=device, offload_activations="none", **kw)


# ---- the link probe after the commit ---------------------------------------------------------------------------------

def test_tight_host_budget_steps_every_step_exactly_once(device):
    """host_memory=1MiB: the probe that sizes the buckets once steps are steady used to allocate 2 MiB after the
    step committed and raise from step() with every weight moved (a retry then stepped twice)."""
    model, opt = wrapped(device, host_memory="1MiB")
    for i in range(STEPS + 2):  # past the steady step that sizes the buckets
        loss_of(model, i, device).backward()
        opt.step()
        opt.zero_grad()
    assert_same_as_torch(model, opt, torch_run(STEPS + 2, device), STEPS + 2, tierflow_run(STEPS + 2, device))


def test_a_failing_link_probe_leaves_the_step_done(device, monkeypatch):
    def failing_probe(*args, **kwargs):
        raise _C.OutOfMemoryError("injected: the link probe's pinned buffers")

    monkeypatch.setattr(streaming_module, "measure_links", failing_probe)
    model, opt = wrapped(device)
    for i in range(STEPS + 2):
        loss_of(model, i, device).backward()
        opt.step()
        opt.zero_grad()
    assert not opt._streaming.sizing_pending, "the sizing was not reached: the test checks nothing"
    assert_same_as_torch(model, opt, torch_run(STEPS + 2, device), STEPS + 2)


# ---- a failure inside step(): nothing moved, and the retry is one step --------------------------------------------------

def _fail_at(monkeypatch, obj, name: str, call: int) -> list:
    """obj.name raises OutOfMemoryError at its ``call``-th call (counted from 1) this step; returns the count."""
    real = getattr(obj, name)
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise _C.OutOfMemoryError(f"injected: {name} call {call}")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


@pytest.mark.parametrize("where, call", [("staging", 5), ("fetch", 6), ("host", 7), ("host", 1)],
                         ids=["staging-5th", "gradient-copy-6th", "new-state-7th", "new-state-1st"])
def test_a_step_that_fails_part_way_changes_nothing_and_the_retry_is_one_step(device, monkeypatch, where, call):
    """Host tier, steps in step() (TIERFLOW_OVERLAP_STEP=off): a failure at any allocation of the step (a state
    made at the first step, a gradient's host copy, a new weight's staging), after other parameters' were made,
    leaves every weight and state bit for bit; the retry gives torch's weights and step counts."""
    model, opt = wrapped(device, overlap_step="off")
    failing_step = 1 if where == "host" else 2  # states are made at the first step only
    for i in range(failing_step - 1):
        loss_of(model, i, device).backward()
        opt.step()
        opt.zero_grad()
    loss_of(model, failing_step - 1, device).backward()
    before = snapshot(model, opt)
    with monkeypatch.context() as m:
        calls = _fail_at(m, opt._copies, where, call)
        with pytest.raises(_C.OutOfMemoryError, match="injected"):
            opt.step()
        assert calls[0] == call
    assert_unchanged(before, snapshot(model, opt))
    opt.step()  # the retry: the same gradients
    opt.zero_grad()
    for i in range(failing_step, STEPS):
        loss_of(model, i, device).backward()
        opt.step()
        opt.zero_grad()
    assert_same_as_torch(model, opt, torch_run(STEPS, device), STEPS, tierflow_run(STEPS, device, overlap_step="off"))


# ---- a host budget that cannot hold one step ---------------------------------------------------------------------------

@pytest.mark.order_free
def test_a_host_budget_that_cannot_hold_one_step_is_refused_at_wrap(device, monkeypatch):
    """The issue's case: states of 3.1 MiB, host_memory=5MiB. The states fit, but a step also holds every
    gradient's host copy and every new weight's staging (2.1 MiB): wrap accepted, and every step raised."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(260, 260) for _ in range(4)]).to(torch_device(device))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for how in ("keyword", "environment"):
        kw = {"host_memory": "5MiB"} if how == "keyword" else {}
        if how == "environment":
            monkeypatch.setenv("TIERFLOW_HOST_MEMORY", "5MiB")
        with pytest.raises(_C.OutOfMemoryError) as err:
            tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device=device, **kw)
        msg = str(err.value)
        assert "needs 5.25 MiB of pinned host memory" in msg and "gradients and new weights" in msg, msg
        assert "TIERFLOW_HOST_MEMORY=5242880" in msg, msg
        assert getattr(model, "_tierflow_session", None) is None
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- steps taken during backward (the default): the stream's part and the Python path's, prepared before either commits

def _edit_one_gradient(model: nn.Module) -> None:
    """A write no version counter shows (Note [Gradient content]): that gradient's early step is stepped again
    from p.grad, in the Python path."""
    p = next(iter(model.parameters()))
    p.grad.data.mul_(0.5)


@pytest.mark.parametrize("max_grad_norm", [None, 0.01], ids=["no-clip", "clip-binds"])
def test_a_tight_host_budget_under_steps_during_backward_steps_every_step_once(device, max_grad_norm):
    """The issue's model (states of 3.1 MiB) at a budget wrap accepts: the early steps' out-of-place results
    crowded out the staging of the steps redone in step(), which raised after committing the others (step counts
    [5, 1, 5, 1, ...]). Now they let go for the rest's room and are redone in place: every step, once."""
    def run(budget):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())])
        model = model.to(torch_device(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kw = {"host_memory": budget} if budget else {}
        if max_grad_norm:
            kw["max_grad_norm"] = max_grad_norm
        model, opt = tierflow.wrap(model, opt, device=device, offload_activations="none", **kw)
        for i in range(STEPS):
            x = torch.randn(8, 256, generator=torch.Generator().manual_seed(i)).to(torch_device(device))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt, tierflow.report()["optimizer"]["streaming"]

    tight, opt, stats = run("5.3MiB")
    roomy, _, _ = run(None)
    assert stats["early_steps"] > 0 and stats["held"] > 0, stats  # the budget bound: the test checks something
    assert {float(s["step"]) for s in opt.state.values()} == {float(STEPS)}
    for (n, p), q in zip(tight.named_parameters(), roomy.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"{n}: not the unconstrained run's bits"


def test_a_failure_in_the_python_path_after_the_streams_verdicts_changes_nothing(device, monkeypatch):
    """Steps during backward, one gradient edited through .data (its step goes to the Python path): a failure
    in the Python path's preparation comes before the stream commits anything; the retry is one step."""
    model, opt = wrapped(device)
    for i in range(2):
        loss_of(model, i, device).backward()
        if i == 1:
            _edit_one_gradient(model)
            before = snapshot(model, opt)
            with monkeypatch.context() as m:
                calls = [0]

                def no_room(*args, **kwargs):  # whatever it would allocate first, each time (the frugal retry too)
                    calls[0] += 1
                    raise _C.OutOfMemoryError("injected: the Python path's room")

                m.setattr(opt, "_prepare_group", no_room)
                with pytest.raises(_C.OutOfMemoryError, match="injected"):
                    opt.step()
                assert calls[0] == 2, "tried as it was, then with the early steps' results let go"
            assert_unchanged(before, snapshot(model, opt))
        opt.step()
        opt.zero_grad()
    expected, eopt = wrapped(device)
    for i in range(2):
        loss_of(expected, i, device).backward()
        if i == 1:
            _edit_one_gradient(expected)
        eopt.step()
        eopt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"{n} differs from a run that never failed"
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}
