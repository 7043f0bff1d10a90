"""tierflow.CPUAdamW against torch.optim.Adam/AdamW, step by step, and its state_dict."""

import io

import pytest
import torch

import tierflow
from harness import assert_close, gpt_task, needs_cuda, train


SIZES = (1, 15, 16, 17, 1_000_003, 0)  # odd sizes around the 16-lane width, a large one, an empty one
# The CPU kernel's own tests step CPU tensors: the device only decides where a
# model's activations go, so these runtimes use the emulated device on every machine.
EMULATED = {"device": "emulated"}


def make_params(dtype=torch.float32, sizes=SIZES):
    g = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in sizes]


def lockstep(torch_cls, steps=100, lr_change_at=None, **hp):
    """Same params, same gradients every step: compare after each step."""
    ref_params = make_params()
    our_params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref = torch_cls(ref_params, **hp)
    ours = tierflow.CPUAdamW.replace(torch_cls(our_params, **hp), tierflow._C.Runtime(EMULATED))
    g = torch.Generator().manual_seed(9)
    for step in range(steps):
        if lr_change_at is not None and step == lr_change_at:
            for group in ref.param_groups + ours.param_groups:
                group["lr"] = group["lr"] * 0.1
        for a, b in zip(ref_params, our_params):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
        for a, b in zip(ref_params, our_params):
            torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("hp", [
    dict(lr=1e-2, weight_decay=0.0),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=3e-3, weight_decay=0.05, amsgrad=True),
    dict(lr=3e-3, maximize=True),
    dict(lr=1e-3, betas=(0.8, 0.95), eps=1e-6),
])
@pytest.mark.ordering
def test_adamw_lockstep(hp):
    lockstep(torch.optim.AdamW, **hp)


@pytest.mark.parametrize("hp", [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, amsgrad=True, weight_decay=0.01)])
@pytest.mark.ordering
def test_adam_lockstep(hp):
    lockstep(torch.optim.Adam, **hp)


@pytest.mark.ordering
def test_learning_rate_changed_mid_run():
    lockstep(torch.optim.AdamW, lr=1e-2, lr_change_at=37)
    lockstep(torch.optim.Adam, lr=1e-2, weight_decay=0.01, lr_change_at=50)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hp", [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1, amsgrad=True)])
@pytest.mark.ordering
def test_16_bit_params_step_an_fp32_master(dtype, hp):
    """16-bit model weights and gradients, fp32 master: the master follows AdamW on fp32."""
    params = make_params(dtype)
    master_ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref = torch.optim.AdamW(master_ref, **hp)
    ours = tierflow.CPUAdamW.replace(torch.optim.AdamW(params, **hp), tierflow._C.Runtime(EMULATED))
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        for p, m in zip(params, master_ref):
            grad = torch.randn(p.shape, generator=g).to(dtype)
            p.grad, m.grad = grad, grad.float()
        ref.step()
        ours.step()
    for p, m in zip(params, master_ref):
        state = ours.state[p]
        torch.testing.assert_close(state["master"], m.detach(), rtol=1e-6, atol=1e-6)
        assert p.dtype == dtype
        assert torch.equal(p.detach(), state["master"].to(dtype)), "the 16-bit copy is the rounded master"


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.ordering
def test_every_simd_path_gives_the_same_parameters(isa):
    from tierflow._C import TierflowError

    def train(setting):
        params = make_params(sizes=(17, 4099))
        opt = tierflow.CPUAdamW.replace(torch.optim.AdamW(params, lr=1e-2, amsgrad=True),
                                        tierflow._C.Runtime(dict(EMULATED, cpu_isa=setting)))
        g = torch.Generator().manual_seed(2)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return params

    try:
        got = train(isa)
    except TierflowError as e:
        pytest.skip(f"this CPU cannot run the {isa} path: {e}")
    for a, b in zip(got, train("portable")):
        assert torch.equal(a, b)


def test_refuses_what_it_cannot_replace():
    # The refusals come from the optimizer's type and groups, the same on every device.
    p = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(tierflow.TierflowError, match="torch.optim.SGD.*accepted: torch.optim.AdamW, torch.optim.Adam"):
        tierflow.wrap(torch.nn.Linear(2, 2), torch.optim.SGD(p, lr=0.1), **EMULATED)

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(tierflow.TierflowError, match="MyAdamW"):
        tierflow.wrap(torch.nn.Linear(2, 2), MyAdamW(p), **EMULATED)
    with pytest.raises(tierflow.TierflowError, match="differentiable"):
        tierflow.wrap(torch.nn.Linear(2, 2), torch.optim.AdamW(p, differentiable=True), **EMULATED)
    # offload_optimizer='none' keeps the user's optimizer untouched.
    m = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    _, same = tierflow.wrap(m, sgd, offload_optimizer="none", **EMULATED)
    assert same is sgd


def test_hyperparameters_and_groups_carry_over():
    # Copying groups and hyperparameters is the same on every device.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.5},
                             {"params": model[1].parameters(), "weight_decay": 0.3}],
                            lr=0.01, betas=(0.8, 0.9), eps=1e-5)
    _, new = tierflow.wrap(model, opt, **EMULATED)
    assert isinstance(new, tierflow.CPUAdamW) and isinstance(new, torch.optim.Optimizer)
    assert [g["lr"] for g in new.param_groups] == [0.5, 0.01]
    assert [g["weight_decay"] for g in new.param_groups] == [0.01, 0.3]
    assert new.param_groups[1]["betas"] == (0.8, 0.9) and new.param_groups[0]["eps"] == 1e-5
    assert new.param_groups[0]["params"] == list(model[0].parameters())


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_state_dict_round_trip_resumes_exactly(device):
    task = gpt_task(dropout=0.0)
    whole = train(task, 5, True, device=device)

    torch.manual_seed(0)
    model = task.model_on(device)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                               device=device)
    for i in range(3):
        task.loss(model, task.batch_on(i, device)).backward()
        opt.step()
        opt.zero_grad()
    ckpt = _save({"model": model.state_dict(), "opt": opt.state_dict()})

    fresh = task.model_on(device)
    fresh, opt2 = tierflow.wrap(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3, weight_decay=0.01),
                                device=device)
    loaded = torch.load(ckpt)
    fresh.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["opt"])
    losses = []
    for i in range(3, 5):
        loss = task.loss(fresh, task.batch_on(i, device))
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        losses.append(loss.item())
    assert losses == whole.losses[3:]
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, whole.params[k]), k


def test_state_dict_loads_into_torch_adamw_and_back(device):
    task = gpt_task(dropout=0.0)
    torch.manual_seed(0)
    model = task.model_on(device)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device)
    for i in range(2):
        task.loss(model, task.batch_on(i, device)).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    # Into torch.optim.AdamW: torch continues from tierflow's moments (moved to the parameters' device).
    twin = task.model_on(device)
    twin.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    torch_opt.load_state_dict(torch.load(_save(sd)))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(torch_opt.state[q]["exp_avg"].cpu(), opt.state[p]["exp_avg"], rtol=0, atol=0)
        assert float(torch_opt.state[q]["step"]) == 2.0
    for i in range(2, 4):
        task.loss(model, task.batch_on(i, device)).backward()
        task.loss(twin, task.batch_on(i, device)).backward()
        opt.step()
        torch_opt.step()
        opt.zero_grad()
        torch_opt.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        # atol: zero-gradient directions (attention key bias), see harness.assert_close.
        torch.testing.assert_close(p, q, rtol=1e-6, atol=5e-5)
    # And torch's state into tierflow: the masters come from the parameters.
    third = task.model_on(device)
    third.load_state_dict(twin.state_dict())
    third, opt3 = tierflow.wrap(third, torch.optim.AdamW(third.parameters(), lr=1e-3), device=device)
    opt3.load_state_dict(torch_opt.state_dict())
    for p, q in zip(third.parameters(), twin.parameters()):
        assert torch.equal(opt3.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"].cpu())
        assert torch.equal(opt3.state[p]["master"], q.detach().cpu())


def test_wrapping_a_stepped_optimizer_keeps_its_state(device):
    task = gpt_task(dropout=0.0)
    base = train(task, 4, False, device=device)
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for i in range(4):
        if i == 2:  # switch to tierflow halfway through
            model, opt = tierflow.wrap(model, opt, device=device)
        loss = task.loss(model, task.batch_on(i, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for a, b in zip(base.losses, losses):
        assert abs(a - b) <= 1e-6 * abs(a)


def test_model_load_state_dict_refreshes_the_masters(device):
    task = gpt_task(dropout=0.0)
    torch.manual_seed(0)
    model = task.model_on(device)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device)
    task.loss(model, task.batch_on(0, device)).backward()
    opt.step()
    opt.zero_grad()
    pretrained = task.model_on(device).state_dict()  # different weights
    model.load_state_dict(pretrained)
    task.loss(model, task.batch_on(1, device)).backward()
    opt.step()
    # The step started from the loaded weights, not from stale masters.
    for (k, p), ref in zip(model.named_parameters(), pretrained.values()):
        assert (p.detach() - ref).abs().max() < 1e-2, k


def test_full_offload_with_adam_l2(device):
    task = gpt_task()
    assert_close(train(task, 3, False, device=device, optimizer_cls=torch.optim.Adam, weight_decay=0.01),
                 train(task, 3, True, device=device, optimizer_cls=torch.optim.Adam, weight_decay=0.01))


@needs_cuda
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_gpu_share_matches_the_cpu_step(fraction):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    twin.load_state_dict(model.state_dict())
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cuda",
                               gpu_optimizer_fraction=fraction)
    tierflow.unwrap(model)
    twin, opt2 = tierflow.wrap(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2), device="cuda",
                               gpu_optimizer_fraction=0)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(5):
        for m, o in ((model, opt), (twin, opt2)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert opt._gpu_share, "some parameters must step on the GPU"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q), "the CUDA kernel computes exactly what the CPU kernel does"


def test_gpu_share_is_inert_without_cuda_parameters(device):
    # The model stays on the CPU on both devices: CPU parameters never step on the GPU, even where one is driven.
    model = torch.nn.Linear(8, 8)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device=device,
                               gpu_optimizer_fraction=1.0)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert opt._gpu_share == set(), "CPU parameters always step on the CPU"


def test_the_gpu_share_stays_inside_the_device_budget():
    # The GPU share (optim/gpu_share.py) took up to half the free device memory, ignoring TIERFLOW_GPU_MEMORY: for the 1.34B preset
    # at 16 GiB, ~9 GB, and the third forward ran out of memory. Its room is now what the first step left of the
    # budget (the [cuda] matrix case, test_matrix.py::test_gpu_optimizer_fraction, runs the real choice).
    from tierflow.optim.gpu_share import gpu_share_room

    GiB = 1 << 30
    assert gpu_share_room(free_bytes=60 * GiB, budget_bytes=16 * GiB, first_step_peak_bytes=15 * GiB) == GiB
    assert gpu_share_room(free_bytes=60 * GiB, budget_bytes=16 * GiB, first_step_peak_bytes=17 * GiB) == 0
    assert gpu_share_room(free_bytes=4 * GiB, budget_bytes=80 * GiB, first_step_peak_bytes=GiB) == 2 * GiB
