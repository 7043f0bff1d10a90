"""TIERFLOW_OPTIMIZER_STATES (keyword optimizer_states): CPUAdamW's moments in bf16 and 8 bits on the host
(Note [Optimizer state formats], Note [Optimizer states in checkpoints]). The fp32 default is
tests/python/test_optimizer.py's, unchanged."""

import io

import pytest
import torch

import tierflow
from tierflow import _C
from harness import gpt_task

EMULATED = "emulated"
FORMATS = ("fp32", "bf16", "8bit")
HP = dict(lr=3e-3, weight_decay=0.01)


def _task():
    return gpt_task(layers=1, width=32, block=32, batch=4, dropout=0.0)


def _wrapped(task, fmt, **settings):
    torch.manual_seed(0)
    model = task.model_on(EMULATED)
    return tierflow.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device=EMULATED,
                         optimizer_states=fmt, **settings)


def _train(task, model, opt, steps, start=0, after_step=None):
    for i in range(start, start + steps):
        task.loss(model, task.batch_on(i, EMULATED)).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(opt)


def _round_states(fmt):
    """After an fp32 step: its moments stored as format ``fmt`` would store them (encoded, decoded back)."""
    def after(opt):
        for s in opt.state.values():
            m, v = _C.decode_moments(*_C.encode_moments(fmt, s["exp_avg"], s["exp_avg_sq"]), s["exp_avg"].numel())
            s["exp_avg"].copy_(m.view(s["exp_avg"].shape))
            s["exp_avg_sq"].copy_(v.view(s["exp_avg_sq"].shape))
    return after


def _decoded(s, like):
    m, v = _C.decode_moments(s["exp_avg"], s["exp_avg_sq"], like.numel())
    return m.view(like.shape), v.view(like.shape)


def _save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.ordering
def test_bf16_moments_are_torch_adamw_rounded_each_step():
    """Same parameters and gradients: the bf16 moments are torch.optim.AdamW's fp32 moments rounded to bf16
    after every step, bit for bit; the parameters agree with that reference as fp32 AdamW's do (Note [Adam
    semantics])."""
    g = torch.Generator().manual_seed(3)
    ref_params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1, 17, 300, 4097)]
    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref = torch.optim.AdamW(ref_params, **HP)
    ours = tierflow.CPUAdamW(ours_params, _C.Runtime({"device": EMULATED}), optimizer_states="bf16", **HP)
    for step in range(20):
        for a, b in zip(ref_params, ours_params):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
        for a, b in zip(ref_params, ours_params):
            sr, so = ref.state[a], ours.state[b]
            for name in ("exp_avg", "exp_avg_sq"):
                sr[name].copy_(sr[name].bfloat16().float())  # the reference: fp32 step, then bf16 storage
                assert so[name].dtype == torch.bfloat16
                assert torch.equal(so[name].float(), sr[name]), f"step {step}: {name}"
            torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.ordering
def test_model_steps_as_fp32_steps_with_its_moments_stored_in_the_format(fmt):
    """A model under tierflow.wrap(optimizer_states=fmt) trains bit for bit as the fp32 CPU step does when its
    moments are encoded into fmt and decoded back after every step: parameters, masters and moments."""
    task = _task()
    model, opt = _wrapped(task, fmt)
    _train(task, model, opt, 4)
    ref_model, ref_opt = _wrapped(task, "fp32", overlap_step="off")
    _train(task, ref_model, ref_opt, 4, after_step=_round_states(fmt))
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
        s, r = opt.state[p], ref_opt.state[q]
        assert s["exp_avg"].dtype == {"bf16": torch.bfloat16, "8bit": torch.uint8}[fmt]
        assert torch.equal(s["master"], r["master"]), name
        m, v = _decoded(s, p)
        assert torch.equal(m, r["exp_avg"]) and torch.equal(v, r["exp_avg_sq"]), name


@pytest.mark.ordering
def test_8bit_stays_close_to_fp32_adamw_in_a_third_of_the_bytes():
    task = _task()
    torch.manual_seed(0)
    base = task.model_on(EMULATED)
    base_opt = torch.optim.AdamW(base.parameters(), **HP)
    _train(task, base, base_opt, 5)
    model, opt = _wrapped(task, "8bit")
    _train(task, model, opt, 5)
    moved = 0.0
    for (name, p), q in zip(model.named_parameters(), base.parameters()):
        start = task.model_on(EMULATED)  # noqa: just the scale of a step: lr * steps
        del start
        err = (p - q).abs().max().item()
        assert err <= 0.1 * HP["lr"] * 5, f"{name}: {err}"  # 10% of the largest possible total move
        moved = max(moved, err)
    assert moved > 0  # 8-bit moments do change the trajectory a little: the test sees the format
    params = [p for g in opt.param_groups for p in g["params"]]
    state_bytes = sum(t.nbytes for p in params for k, t in opt.state[p].items() if k != "step")
    elements = sum(p.numel() for p in params)
    assert state_bytes / elements <= 6.5, state_bytes / elements  # fp32 master 4 + moments 2 + scales


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.ordering
def test_state_dict_resume_is_bit_for_bit(fmt):
    task = _task()
    model, opt = _wrapped(task, fmt)
    _train(task, model, opt, 5)
    whole = {k: v.clone() for k, v in model.state_dict().items()}

    model, opt = _wrapped(task, fmt)
    _train(task, model, opt, 3)
    sd = opt.state_dict()
    if fmt == "8bit":  # codes shaped like the parameter, scales beside them; no "exp_avg" (torch would load it)
        p0 = next(model.parameters())
        s0 = sd["state"][0]
        assert "exp_avg" not in s0 and "exp_avg_sq" not in s0
        assert s0["exp_avg_codes"].shape == p0.shape and s0["exp_avg_codes"].dtype == torch.uint8
        assert s0["exp_avg_absmax"].dtype == torch.float32
        assert s0["exp_avg_codes"].data_ptr() == opt.state[p0]["exp_avg"].data_ptr()
    ckpt = _save({"model": model.state_dict(), "opt": sd})
    fresh, opt2 = _wrapped(task, fmt)
    fresh.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    _train(task, fresh, opt2, 2, start=3)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, whole[k]), k


@pytest.mark.ordering
def test_cross_format_loads_convert_and_say_so(capfd):
    task = _task()
    model, opt = _wrapped(task, "8bit")
    _train(task, model, opt, 3)
    sd8 = _save(opt.state_dict())
    capfd.readouterr()
    # 8bit into fp32: the decoded moments, one line naming the conversion.
    m32, opt32 = _wrapped(task, "fp32", log_level="info")
    m32.load_state_dict(model.state_dict())
    opt32.load_state_dict(sd8)
    err = capfd.readouterr().err
    assert err.count("optimizer states loaded (a state dict, or the optimizer tierflow.wrap replaced) are 8bit; "
                     "converted to fp32 (TIERFLOW_OPTIMIZER_STATES)") == 1
    for p, q in zip(model.parameters(), m32.parameters()):
        m, v = _decoded(opt.state[p], p)
        assert opt32.state[q]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt32.state[q]["exp_avg"], m) and torch.equal(opt32.state[q]["exp_avg_sq"], v)
    # And back into 8bit: the same codes and scales (decode then encode is the identity).
    m8, opt8 = _wrapped(task, "8bit", log_level="info")
    opt8.load_state_dict(_save(opt32.state_dict()))
    assert "replaced) are fp32; converted to 8bit" in capfd.readouterr().err
    for p, q in zip(model.parameters(), m8.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt8.state[q][name], opt.state[p][name]), name
    # torch.optim.AdamW's state dict into an 8bit CPUAdamW: its moments encoded.
    torch.manual_seed(0)
    twin = task.model_on(EMULATED)
    torch_opt = torch.optim.AdamW(twin.parameters(), **HP)
    _train(task, twin, torch_opt, 2)
    m8b, opt8b = _wrapped(task, "8bit", log_level="info")
    m8b.load_state_dict(twin.state_dict())
    opt8b.load_state_dict(torch_opt.state_dict())
    assert "replaced) are fp32; converted to 8bit" in capfd.readouterr().err
    for p, q in zip(twin.parameters(), m8b.parameters()):
        s = torch_opt.state[p]
        want = _C.encode_moments("8bit", s["exp_avg"], s["exp_avg_sq"])
        assert torch.equal(opt8b.state[q]["exp_avg"], want[0]) and torch.equal(opt8b.state[q]["exp_avg_sq"], want[1])
        assert float(opt8b.state[q]["step"]) == 2.0
    _train(task, m8b, opt8b, 1, start=2)  # and it steps on


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.ordering
def test_amsgrad_is_refused_with_packed_moments(fmt):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(_C.ConfigError, match=f"amsgrad keeps fp32 moments; TIERFLOW_OPTIMIZER_STATES={fmt} "
                                             rf"\(keyword optimizer_states={fmt}\) is refused with it "
                                             r"\(accepted: fp32\)"):
        tierflow.wrap(model, torch.optim.AdamW(model.parameters(), amsgrad=True), device=EMULATED,
                      optimizer_states=fmt)
    opt = tierflow.CPUAdamW([torch.nn.Parameter(torch.zeros(3))], _C.Runtime({"device": EMULATED}),
                            optimizer_states=fmt)
    with pytest.raises(_C.ConfigError, match="amsgrad keeps fp32 moments"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True})
    assert len(opt.param_groups) == 1


def test_bad_formats_are_refused_by_name():
    with pytest.raises(_C.ConfigError, match="TIERFLOW_OPTIMIZER_STATES.*one of fp32, bf16, 8bit"):
        _C.Runtime({"TIERFLOW_OPTIMIZER_STATES": "fp16", "device": EMULATED})
    with pytest.raises(_C.ConfigError, match="optimizer_states='int4'.*accepted: fp32, bf16, 8bit"):
        tierflow.CPUAdamW([torch.nn.Parameter(torch.zeros(3))], _C.Runtime({"device": EMULATED}),
                          optimizer_states="int4")
    with pytest.raises(_C.ConfigError, match="accepted: fp32, bf16, 8bit"):
        _C.moment_bytes("fp16", 3)


def test_the_host_pool_check_counts_the_formats_bytes():
    """A pinned pool that holds 8-bit states but not fp32 ones: the state tier's check (wrap's first step) takes
    the format's bytes (6.03 a parameter of a device model), not fp32's 12."""
    states = [(1 << 20, False, 2)]  # a 1 Mi-element bf16 parameter on the device
    need = {f: _C.optimizer_state_bytes(1 << 20, False, f) for f in FORMATS}
    assert need["8bit"] < need["bf16"] < need["fp32"]
    budget = (need["8bit"] + need["fp32"]) // 2 + 4 * (1 << 20)  # and the gradient and staging blocks beside (2 x 2 MiB)
    with pytest.raises(_C.OutOfMemoryError, match="TIERFLOW_HOST_MEMORY=test budget"):
        _C.check_optimizer_state_pool(states, False, budget, "test budget", "fp32")
    _C.check_optimizer_state_pool(states, False, budget, "test budget", "8bit")


def test_the_keyword_sets_every_tiers_format():
    """CPUAdamW(optimizer_states=...) over a runtime configured otherwise: the state tier and the GPU share take
    the keyword's format, not the configuration's."""
    rt = _C.Runtime({"device": EMULATED, "TIERFLOW_OPTIMIZER_STATES": "fp32"})
    opt = tierflow.CPUAdamW([torch.nn.Parameter(torch.zeros(3))], rt, optimizer_states="8bit")
    assert opt._states.format == "8bit"
    assert opt._gpu.state_format == "8bit"


@pytest.mark.parametrize("fmt,per_param", [("fp32", 12.0), ("bf16", 8.0), ("8bit", 6.0)])
@pytest.mark.ordering
def test_the_report_says_what_the_states_hold(fmt, per_param):
    """report() names the format and counts the states' bytes: master (4) + moments, 12, 8 or about 6 a
    parameter of a bf16 model (the 8-bit codes' padding and scales add a little on small tensors)."""
    task = _task()
    torch.manual_seed(0)
    model = task.model_on(EMULATED).to(torch.bfloat16)
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), **HP), device=EMULATED,
                               optimizer_states=fmt)
    _train(task, model, opt, 1)
    st = tierflow.report()["optimizer"]["states"]
    n = sum(p.numel() for p in model.parameters())
    assert (st["format"], st["elements"], st["tier"]) == (fmt, n, "host")
    assert per_param <= st["bytes"] / n <= per_param + (0.5 if fmt == "8bit" else 0.0)
    assert f"{fmt} moments" in str(tierflow.report())


@pytest.mark.ordering
def test_an_8bit_state_dict_is_not_taken_for_moments_by_torch():
    """torch.optim.AdamW loading an 8-bit state dict: no "exp_avg" there, so its step stops at the missing key
    instead of stepping on the codes cast to floats (the review found it did)."""
    task = _task()
    model, opt = _wrapped(task, "8bit")
    _train(task, model, opt, 2)
    sd = _save(opt.state_dict())
    torch.manual_seed(0)
    twin = task.model_on(EMULATED)
    torch_opt = torch.optim.AdamW(twin.parameters(), **HP)
    torch_opt.load_state_dict(sd)
    task.loss(twin, task.batch_on(0, EMULATED)).backward()
    with pytest.raises(KeyError, match="exp_avg"):
        torch_opt.step()


@pytest.mark.ordering
def test_amsgrad_from_a_state_dict_or_set_later_is_refused_before_anything_changes():
    task = _task()
    model, opt = _wrapped(task, "8bit")
    _train(task, model, opt, 1)
    torch.manual_seed(0)
    twin = task.model_on(EMULATED)
    ams = torch.optim.AdamW(twin.parameters(), amsgrad=True, **HP)
    _train(task, twin, ams, 1)
    steps = [float(s["step"]) for s in opt.state.values()]
    with pytest.raises(_C.ConfigError, match="amsgrad keeps fp32 moments; TIERFLOW_OPTIMIZER_STATES=8bit"):
        opt.load_state_dict(ams.state_dict())
    assert [g["amsgrad"] for g in opt.param_groups] == [False] * len(opt.param_groups)
    assert [float(s["step"]) for s in opt.state.values()] == steps
    opt.param_groups[0]["amsgrad"] = True  # set by hand: refused by name at the next backward, not in the kernel
    with pytest.raises(_C.ConfigError, match="param group 0 has amsgrad=True"):
        task.loss(model, task.batch_on(1, EMULATED)).backward()
        opt.step()
