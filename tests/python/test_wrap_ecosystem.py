"""tierflow.wrap with the objects training tools build around an optimizer (issue 19, the training-loop ecosystem):

- an LR scheduler created before ``wrap`` keeps scheduling: the CPUAdamW shares the replaced optimizer's
  param_group dicts, so the scheduler (still holding the old optimizer) reaches it, with no spurious
  "lr_scheduler.step() before optimizer.step()" warning;
- an optimizer wrapper exposing ``.optimizer`` (accelerate's AcceleratedOptimizer and the like) is unwrapped in
  place when it holds the optimizer only there, and refused with the right order (wrap first, then prepare)
  when it keeps other references to it;
- an optimizer over parameters that are not the model's is refused, naming how many and a shape.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import tierflow
from harness import DEVICES, gpt_task

STEPS = 6
LR = 1e-3

SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    # cycle_momentum: it schedules AdamW's betas too.
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS + 1),
}


def _lr_scheduler_warnings(caught: list) -> list:
    return [str(w.message) for w in caught if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]


def _train(device: str, make_scheduler, order: str, wrapped: bool, **settings) -> dict:
    """STEPS steps of a small GPT with torch AdamW (two groups), the scheduler made `order` ("before"/"after")
    wrap; returns losses, the lr and betas each step and the parameters."""
    task = gpt_task(layers=2, width=32, block=32, batch=4, dropout=0.0)
    torch.manual_seed(0)
    model = task.model_on(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}],
                            lr=LR, weight_decay=0.01)
    sched = make_scheduler(opt) if order == "before" else None
    if wrapped:
        model, opt = tierflow.wrap(model, opt, device=device, **settings)
    if order == "after":
        sched = make_scheduler(opt)
    out = {"losses": [], "lrs": [], "betas": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            loss = task.loss(model, task.batch_on(step, device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # What the optimizer that steps uses, not what the scheduler believes.
            out["lrs"].append([float(g["lr"]) for g in opt.param_groups])
            out["betas"].append([tuple(g["betas"]) for g in opt.param_groups])
            sched.step()
            out["losses"].append(loss.item())
    out["warnings"] = _lr_scheduler_warnings(caught)
    out["params"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if wrapped:
        assert isinstance(opt, tierflow.CPUAdamW)
        tierflow.unwrap(model)
    return out


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_made_before_or_after_wrap_schedules_the_cpu_optimizer(device, order, name):
    base = _train(device, SCHEDULERS[name], order, wrapped=False)
    ours = _train(device, SCHEDULERS[name], order, wrapped=True)
    assert base["lrs"][-1] != base["lrs"][0], "the schedule must move the lr for this test to mean anything"
    assert ours["lrs"] == base["lrs"], f"lrs: {ours['lrs']} vs the baseline's {base['lrs']}"
    assert ours["betas"] == base["betas"]
    for i, (x, y) in enumerate(zip(base["losses"], ours["losses"])):
        assert abs(x - y) <= 1e-5 * abs(x), f"step {i}: loss {y} vs the baseline's {x}"
    for k, v in base["params"].items():
        torch.testing.assert_close(ours["params"][k], v, rtol=1e-5, atol=5e-5, msg=f"parameter {k}")
    assert ours["warnings"] == base["warnings"] == [], ours["warnings"]


@pytest.mark.ordering
def test_scheduler_made_before_wrap_survives_load_state_dict():
    """A resume (opt.load_state_dict on the CPUAdamW; accelerate's prepare does one too) keeps the groups shared."""
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, new = tierflow.wrap(model, opt, device="emulated")
    model(torch.randn(2, 8)).sum().backward()
    new.step()
    new.load_state_dict(new.state_dict())
    sched.step()
    assert new.param_groups[0]["lr"] == 0.05
    assert new.param_groups[0] is opt.param_groups[0] and new.param_groups is opt.param_groups
    assert new.param_groups[0]["initial_lr"] == 0.1
    tierflow.unwrap(model)


# ---- optimizer wrappers (accelerate's AcceleratedOptimizer and the like) ----------------------------------------


class Wrapper(torch.optim.Optimizer):
    """Delegates to ``self.optimizer`` as accelerate's AcceleratedOptimizer does, counting its calls."""

    def __init__(self, optimizer):  # noqa: D107  (no Optimizer.__init__, as accelerate)
        self.optimizer = optimizer
        self.steps = 0
        self.zero_grads = 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)

    def step(self, closure=None):
        self.steps += 1
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.zero_grads += 1
        self.optimizer.zero_grad(set_to_none=set_to_none)


class PlainWrapper:
    """Not a torch.optim.Optimizer at all: only ``.optimizer``, step and zero_grad."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


class CachingWrapper(Wrapper):
    """Keeps the wrapped optimizer's bound step, as AcceleratedOptimizer does with a GradScaler."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._original_step = optimizer.step

    def step(self, closure=None):
        return self._original_step(closure)


def _run_through(wrapper_cls, device, wrapped: bool, nest: int = 1):
    task = gpt_task(layers=2, width=32, block=32, batch=4, dropout=0.0)
    torch.manual_seed(0)
    model = task.model_on(device)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = inner
    for _ in range(nest):
        opt = wrapper_cls(opt)
    outer = opt
    if wrapped:
        model, opt = tierflow.wrap(model, opt, device=device)
        assert opt is outer, "wrap returns the wrapper the loop already uses"
    losses = []
    for step in range(4):
        loss = task.loss(model, task.batch_on(step, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if wrapped:
        tierflow.unwrap(model)
    return losses, opt, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("wrapper_cls,nest", [(Wrapper, 1), (Wrapper, 2), (PlainWrapper, 1)],
                         ids=["optimizer-subclass", "nested", "plain-object"])
def test_optimizer_wrapper_is_unwrapped_in_place(device, wrapper_cls, nest):
    base, _, base_params = _run_through(wrapper_cls, device, wrapped=False, nest=nest)
    ours, wrapper, params = _run_through(wrapper_cls, device, wrapped=True, nest=nest)
    innermost = wrapper
    for _ in range(nest):
        innermost = innermost.optimizer
    assert isinstance(innermost, tierflow.CPUAdamW)
    if isinstance(wrapper, Wrapper):
        assert wrapper.steps == 4 and wrapper.zero_grads == 4
        assert len(wrapper.state_dict()["state"]) == len(wrapper.param_groups[0]["params"])  # the CPUAdamW's
    for i, (x, y) in enumerate(zip(base, ours)):
        assert abs(x - y) <= 1e-5 * abs(x), f"step {i}: loss {y} vs the baseline's {x}"
    for k, v in base_params.items():
        torch.testing.assert_close(params[k], v, rtol=1e-5, atol=5e-5, msg=f"parameter {k}")


def test_optimizer_wrapper_with_its_own_reference_is_refused_with_the_order():
    model = nn.Linear(8, 4)
    opt = CachingWrapper(torch.optim.AdamW(model.parameters()))
    with pytest.raises(tierflow.TierflowError, match=r"CachingWrapper.*_original_step.*wrap\(model, optimizer\) first"):
        tierflow.wrap(model, opt, device="emulated")
    assert getattr(model, "_tierflow_session", None) is None
    assert isinstance(opt.optimizer, torch.optim.AdamW)  # left as it was
    # With the optimizer kept (offload_optimizer=none) there is nothing to replace: accepted as is.
    _, same = tierflow.wrap(model, opt, device="emulated", offload_optimizer="none")
    assert same is opt
    tierflow.unwrap(model)


@pytest.mark.ordering
def test_accelerate_prepare_then_wrap():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (not part of the set-up); "
                                                          "the generic wrapper tests above cover its pattern")
    task = gpt_task(layers=2, width=32, block=32, batch=4, dropout=0.0)

    def run(wrapped: bool) -> list:
        torch.manual_seed(0)
        accelerator = accelerate.Accelerator(cpu=True)
        model = task.model_on("emulated")
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = accelerator.prepare(model, opt)
        if wrapped:
            model, opt2 = tierflow.wrap(model, opt, device="emulated")
            assert opt2 is opt and isinstance(opt.optimizer, tierflow.CPUAdamW)
        losses = []
        for step in range(4):
            loss = task.loss(model, task.batch_on(step, "emulated"))
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if wrapped:
            tierflow.unwrap(model)
        return losses

    base, ours = run(False), run(True)
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(base, ours)), (base, ours)


# ---- an optimizer over parameters that are not the model's --------------------------------------------------------


@pytest.mark.parametrize("offload_optimizer", ["host", "none"])
def test_optimizer_over_another_models_parameters_is_refused(offload_optimizer):
    torch.manual_seed(0)
    model, other = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(tierflow.TierflowError,
                       match=r"4 of the optimizer's 4 parameters are not parameters of the model.*\[16, 8\]"):
        tierflow.wrap(model, opt, device="emulated", offload_optimizer=offload_optimizer)
    assert getattr(model, "_tierflow_session", None) is None
    # One stray parameter among the model's is refused too.
    stray = nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.AdamW([*model.parameters(), stray])
    with pytest.raises(tierflow.TierflowError, match=r"1 of the optimizer's 5 parameters .*\[3, 5\]"):
        tierflow.wrap(model, opt, device="emulated", offload_optimizer=offload_optimizer)


@pytest.mark.ordering
def test_optimizer_over_part_of_the_model_is_accepted():
    """Frozen parameters, or a second optimizer for the rest: the model's parameters the optimizer lacks are fine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)
    first = torch.optim.AdamW([p for p in model[2].parameters()], lr=LR)
    second = torch.optim.SGD([model[0].bias], lr=LR)
    model, first = tierflow.wrap(model, first, device="emulated")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 8)).sum().backward()
    first.step()
    second.step()
    after = model.state_dict()
    assert torch.equal(after["0.weight"], before["0.weight"])
    assert not torch.equal(after["0.bias"], before["0.bias"]) and not torch.equal(after["2.weight"], before["2.weight"])
    tierflow.unwrap(model)


# ---- torch.compile and CUDA graphs (Note [Hooks outside graphs] in _compile.py) ---------------------------------


@pytest.mark.parametrize("mode", ["auto", "host", "recompute"])
def test_torch_compile_runs_the_hooks_eagerly_and_says_once_that_it_does_not_mix(device, mode):
    # dynamo used to trace into tierflow's hooks, break the graph dozens of times inside them and say nothing.
    # Now the hooks run outside the graphs: the compiled model trains as eager does (the eager backend compiles
    # nothing numeric, so bit for bit), tierflow warns once, and dynamo breaks only at the hooked modules.
    import torch._dynamo
    from tierflow import _compile

    task = gpt_task(layers=2, width=32, block=16, batch=4)

    def run(compiled: bool) -> list:
        torch.manual_seed(0)
        model = task.model_on(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if compiled:
            model, opt = tierflow.wrap(model, opt, device=device, offload_activations=mode,
                                       offload_optimizer="none", min_offload_bytes=0)
            model = torch.compile(model, backend="eager")
        losses = []
        for step in range(4):
            loss = task.loss(model, task.batch_on(step, device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _compile._said = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert run(True) == run(False)
    ours = [str(w.message) for w in seen if str(w.message).startswith("tierflow: torch.compile")]
    assert len(ours) == 1 and "do not mix" in ours[0], ours
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert not any("Runtime" in reason or "saved_tensors_hooks" in reason for reason in breaks), list(breaks)
    torch._dynamo.reset()


def test_cuda_graph_capture_through_a_wrapped_model_is_refused(monkeypatch):
    # A hook reached while a stream captures raises before it does anything (on a GPU: the [cuda] case below).
    from tierflow import _compile

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model, _ = tierflow.wrap(model, None, device="emulated", offload_optimizer="none")
    monkeypatch.setattr(_compile, "capturing", lambda: True)
    with pytest.raises(tierflow.TierflowError, match="CUDA graph is being captured"):
        model(torch.randn(2, 8, requires_grad=True))
    monkeypatch.setattr(_compile, "capturing", lambda: False)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()  # nothing was left half-done


@pytest.mark.skipif(not torch.cuda.is_available() or not tierflow._C.cuda_available(),
                    reason="needs a CUDA GPU and tierflow's CUDA backend; this machine has none")
def test_cuda_graph_capture_through_a_wrapped_model_is_refused_on_cuda():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).cuda()
    model, _ = tierflow.wrap(model, None, device="cuda", offload_optimizer="none")
    x = torch.randn(2, 8, device="cuda", requires_grad=True)
    model(x).sum().backward()  # warm-up, as capture needs
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(tierflow.TierflowError, match="CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            model(x)
