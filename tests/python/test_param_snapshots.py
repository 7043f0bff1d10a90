"""Reading, saving, editing and converting parameters that live off the device (TIERFLOW_OFFLOAD_PARAMS=host|nvme;
issue 38 item 5, item 3's gathered(), model.to() after wrap; Note [Parameter state] in tierflow/_param_state.py).

On transformers' GPT-2 from the model zoo (4 blocks of width 32, its lm_head tied to its embedding), with torch's
AdamW stepping the host copies (offload_optimizer="none": the emulated device only), against the same model
trained without tierflow, bit for bit:
- state_dict() returns copies that later steps do not change (the "keep the best weights" idiom), one per
  parameter, the same tensor under both keys of a tied weight, and loading such a snapshot back trains exactly as
  the baseline restarted from it;
- tierflow.gathered(...) makes the parameters readable outside forward and backward, writes back only with
  modify=True, and is refused inside a forward or backward and beyond TIERFLOW_GPU_MEMORY;
- model.half() (any real conversion) after wrap is refused, changing nothing; model.to(the same device) works.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import tierflow
from harness import Task

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")

from test_model_zoo import ZOO  # noqa: E402  (GPT-2 built the zoo's way)

OPT_NONE = dict(offload_optimizer="none", min_offload_bytes=0)
TIED = ("lm_head.weight", "transformer.wte.weight")
TIERS = ["host", "nvme"]


@pytest.fixture(autouse=True)
def _quiet_wrap_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tierflow.wrap: .* has config.use_cache=True")
        yield


def _emulated_only(device: str) -> None:
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device (on CUDA it is refused)")


def _task() -> Task:
    return ZOO["gpt2"][0]()


def _plain(task: Task, device: str):
    torch.manual_seed(0)
    model = task.model_on(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _wrapped(task: Task, device: str, tier: str, nvme_dir: str, **settings):
    model, opt = _plain(task, device)
    where = dict(nvme_paths=[nvme_dir]) if tier == "nvme" else {}
    return tierflow.wrap(model, opt, device=device, offload_params=tier, **where, **OPT_NONE, **settings)


def _steps(task: Task, model, opt, first: int, n: int, device: str) -> list:
    losses = []
    for i in range(first, first + n):
        loss = task.loss(model, task.batch_on(i, device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _values(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


def _on_device(model, p) -> bool:
    impl = model._tierflow_session.params.impl
    return impl.on_device(p) if hasattr(impl, "on_device") else p.untyped_storage().nbytes() > 0


def _released(model) -> bool:
    offload = model._tierflow_session.params
    return all(not _on_device(model, p) for p in model.parameters() if offload.offloaded(p))


# -- state_dict() ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", TIERS)
def test_a_state_dict_snapshot_is_not_changed_by_later_steps(device, tier, nvme_dir):
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    _steps(task, plain, plain_opt, 0, 1, device)
    after_one = _values(plain)
    model, opt = _wrapped(task, device, tier, nvme_dir)
    _steps(task, model, opt, 0, 1, device)
    best = {k: v.cpu() for k, v in model.state_dict().items()}  # "keep the best weights"
    _assert_equal(best, after_one)
    _steps(task, model, opt, 1, 2, device)
    _assert_equal(best, after_one)  # the snapshot did not follow the two steps
    later = model.state_dict()
    assert not torch.equal(later["transformer.h.0.attn.c_attn.weight"], best["transformer.h.0.attn.c_attn.weight"])
    # A snapshot kept holds none of the pinned pool (an NVMe model's would be its whole weights there).
    pool = model._tierflow_session.runtime.stats()["host_pool"]["in_use"]["current"]
    kept = [model.state_dict() for _ in range(3)]
    assert model._tierflow_session.runtime.stats()["host_pool"]["in_use"]["current"] == pool, len(kept)


class _CountingLoads:
    """offload.impl with its reads of a parameter's value counted (ParamResidency::load)."""

    def __init__(self, impl) -> None:
        self._impl, self.loads = impl, 0

    def load(self, p):
        self.loads += 1
        return self._impl.load(p)

    def __getattr__(self, name):
        return getattr(self._impl, name)


@pytest.mark.parametrize("tier", TIERS)
def test_a_tied_weight_is_one_tensor_and_each_parameter_one_copy(device, tier, nvme_dir):
    _emulated_only(device)
    task = _task()
    plain, _ = _plain(task, device)
    want = plain.state_dict()
    assert want[TIED[0]].data_ptr() == want[TIED[1]].data_ptr()  # PyTorch: one storage under both keys
    model, opt = _wrapped(task, device, tier, nvme_dir)
    offload = model._tierflow_session.params
    counting = offload.impl = _CountingLoads(offload.impl)
    got = model.state_dict()
    assert got[TIED[0]] is got[TIED[1]]
    assert counting.loads == len(list(model.parameters()))  # one read (and copy) per parameter, the tied one once
    _assert_equal(got, want)
    # keep_vars=True: the parameters themselves, as PyTorch gives them (identity, requires_grad).
    variables = model.state_dict(keep_vars=True)
    for name, p in model.named_parameters(remove_duplicate=False):
        assert variables[name] is p, name


@pytest.mark.parametrize("tier", TIERS)
def test_loading_a_snapshot_back_trains_as_the_baseline_restarted_from_it(device, tier, nvme_dir):
    _emulated_only(device)
    task = _task()
    model, opt = _wrapped(task, device, tier, nvme_dir)
    _steps(task, model, opt, 0, 2, device)
    snapshot, opt_snapshot, rng = model.state_dict(), copy.deepcopy(opt.state_dict()), torch.get_rng_state()
    _steps(task, model, opt, 2, 2, device)  # trained on past the snapshot, then back to it
    model.load_state_dict(snapshot)
    opt.load_state_dict(copy.deepcopy(opt_snapshot))
    torch.set_rng_state(rng)
    resumed = _steps(task, model, opt, 2, 2, device)
    # The baseline: a model without tierflow restarted from the same snapshot.
    plain, plain_opt = _plain(task, device)
    plain.load_state_dict(snapshot)
    plain_opt.load_state_dict(copy.deepcopy(opt_snapshot))
    torch.set_rng_state(rng)
    assert resumed == _steps(task, plain, plain_opt, 2, 2, device)
    _assert_equal(_values(model), _values(plain))


def test_loading_with_assign_is_refused_and_changes_nothing(device):
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    want = _steps(task, plain, plain_opt, 0, 2, device)
    model, opt = _wrapped(task, device, "host", "")
    _steps(task, model, opt, 0, 1, device)
    before, params = _values(model), list(model.parameters())
    other = {k: torch.zeros_like(v) for k, v in before.items()}
    with pytest.raises(tierflow.ConfigError, match=r"load_state_dict\(\.\.\., assign=True\) after tierflow\.wrap "
                                                   r"would replace parameter 'transformer\.wte\.weight'.*"
                                                   r"load without assign.*Nothing was changed"):
        model.load_state_dict(other, assign=True)
    assert list(model.parameters()) == params
    _assert_equal(_values(model), before)
    assert _steps(task, model, opt, 1, 1, device) == want[1:]


# -- gathered() ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tier", TIERS)
def test_gathered_parameters_are_their_values_and_released_after(device, tier, nvme_dir):
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    _steps(task, plain, plain_opt, 0, 2, device)
    model, opt = _wrapped(task, device, tier, nvme_dir)
    _steps(task, model, opt, 0, 2, device)
    assert _released(model)
    names = {id(p): k for k, p in model.named_parameters()}
    want = plain.state_dict()
    with tierflow.gathered(model):
        read = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    assert read.keys() == {k for k, _ in plain.named_parameters()}
    for k, v in read.items():
        assert torch.equal(v, want[k]), k
    assert _released(model) and tierflow.report()["params"]["device_bytes"] == 0
    # Modules, a list, one parameter: each gathered; a parameter tierflow does not hold passes through.
    block = model.transformer.h[1]
    with tierflow.gathered([block.attn, model.lm_head.weight, torch.nn.Parameter(torch.ones(2))]):
        assert torch.equal(block.attn.c_proj.weight.detach().clone(), want["transformer.h.1.attn.c_proj.weight"])
        assert torch.equal(model.lm_head.weight.detach().clone(), want["lm_head.weight"])
        assert not _on_device(model, block.mlp.c_fc.weight)  # not asked for
    assert _released(model)
    with tierflow.gathered(plain):  # no tierflow: nothing to do
        pass
    # Training goes on as the baseline's (from the same random state: dropout's).
    rng = torch.get_rng_state()
    losses = _steps(task, model, opt, 2, 1, device)
    torch.set_rng_state(rng)
    assert losses == _steps(task, plain, plain_opt, 2, 1, device)


def _halve_norm_weights(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln_1.weight", "ln_f.weight")) or name == "transformer.wpe.weight":
                p.mul_(0.5)


@pytest.mark.parametrize("tier", TIERS)
def test_gathered_modify_writes_back_and_the_next_step_trains_from_it(device, tier, nvme_dir):
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    _steps(task, plain, plain_opt, 0, 1, device)
    _halve_norm_weights(plain)
    want_losses = _steps(task, plain, plain_opt, 1, 2, device)
    model, opt = _wrapped(task, device, tier, nvme_dir)
    _steps(task, model, opt, 0, 1, device)
    with tierflow.gathered(model, modify=True):
        _halve_norm_weights(model)
        assert torch.equal(model.state_dict()["transformer.ln_f.weight"], model.transformer.ln_f.weight.detach())
    assert _released(model)
    assert _steps(task, model, opt, 1, 2, device) == want_losses
    _assert_equal(_values(model), _values(plain))


@pytest.mark.parametrize("tier", TIERS)
def test_gathered_modify_reaches_the_cpu_optimizers_masters(device, tier, nvme_dir):
    """tierflow's CPU AdamW keeps fp32 masters apart from the host copies: an edit written back is stepped from,
    bit for bit as the same optimizer with the parameters on the device and the same edit."""
    _emulated_only(device)
    task = _task()

    def run(**where) -> tuple:
        model, opt = _plain(task, device)
        model, opt = tierflow.wrap(model, opt, device=device, min_offload_bytes=0, **where)
        losses = _steps(task, model, opt, 0, 1, device)
        with tierflow.gathered(model, modify=True):  # nothing to gather with offload_params="none"
            _halve_norm_weights(model)
        losses += _steps(task, model, opt, 1, 2, device)
        values = _values(model)
        tierflow.unwrap(model)
        return losses, values

    want_losses, want = run(offload_params="none")
    where = dict(nvme_paths=[nvme_dir]) if tier == "nvme" else {}
    losses, got = run(offload_params=tier, **where)
    assert losses == want_losses
    _assert_equal(got, want)


def test_a_failed_write_back_at_gathered_exit_keeps_the_edit_for_the_cpu_optimizer(device, nvme_dir):
    """A write to NVMe that fails at gathered(modify=True)'s exit raises, saying the values are kept in host memory;
    every hold is released, and the CPU AdamW steps a 16-bit model from the edit (its fp32 masters re-read), as
    when the write works."""
    _emulated_only(device)
    task = _task()

    def run(fail: bool) -> tuple:
        faults = tierflow._C.NvmeFaults()
        torch.manual_seed(0)
        model = task.model_on(device).to(torch.bfloat16)  # 16-bit: the CPU AdamW's fp32 masters are apart
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        model, opt = tierflow.wrap(model, opt, device=device, min_offload_bytes=0, offload_params="nvme",
                                   nvme_paths=[nvme_dir], _nvme_faults=faults)
        losses = _steps(task, model, opt, 0, 1, device)
        with pytest.raises(OSError, match="kept in host memory") if fail else contextlib.nullcontext():
            with tierflow.gathered(model, modify=True):
                _halve_norm_weights(model)
                faults.fail_writes = int(fail)
        assert faults.fail_writes == 0, "the fault was used"
        assert _released(model) and tierflow.report()["params"]["device_bytes"] == 0
        losses += _steps(task, model, opt, 1, 2, device)
        values = _values(model)
        tierflow.unwrap(model)
        return losses, values

    want_losses, want = run(False)
    losses, got = run(True)
    assert losses == want_losses
    _assert_equal(got, want)


@pytest.mark.parametrize("tier", TIERS)
def test_a_write_back_that_cannot_be_made_at_gathered_exit_discards_the_edit(device, tier, nvme_dir):
    """A copy from the device that fails at gathered(modify=True)'s exit: the edit cannot be written back, so it is
    discarded and said so, and every parameter is released; training goes on as if the edit was never made."""
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    _steps(task, plain, plain_opt, 0, 1, device)
    want_losses = _steps(task, plain, plain_opt, 1, 2, device)  # no edit: it was discarded
    faults = tierflow._C.CopyFaults()
    model, opt = _wrapped(task, device, tier, nvme_dir, _copy_faults=faults)
    _steps(task, model, opt, 0, 1, device)
    with pytest.raises(OSError, match=r"tierflow\.gathered: the values written inside the block to 'transformer\..*"
                                      r"could not be written back and are discarded"):
        with tierflow.gathered(model, modify=True):
            _halve_norm_weights(model)
            faults.fail_d2h_copies = 1
    assert faults.fail_d2h_copies == 0, "the fault was used"
    assert _released(model) and tierflow.report()["params"]["device_bytes"] == 0
    assert _steps(task, model, opt, 1, 2, device) == want_losses
    _assert_equal(_values(model), _values(plain))


@pytest.mark.parametrize("tier", TIERS)
def test_an_edit_inside_gathered_without_modify_is_refused_and_discarded(device, tier, nvme_dir):
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    _steps(task, plain, plain_opt, 0, 1, device)
    want_losses = _steps(task, plain, plain_opt, 1, 1, device)  # no edit: it was discarded
    model, opt = _wrapped(task, device, tier, nvme_dir)
    _steps(task, model, opt, 0, 1, device)
    with tierflow.gathered(model):  # reading only: nothing written back
        read = model.transformer.ln_f.weight.detach().clone()
    with pytest.raises(tierflow.TierflowError, match=r"gathered\(\.\.\., modify=False\): 'transformer\.wpe\."
                                                     r"weight', 'transformer\.h\.0\.ln_1\.weight'.* and others "
                                                     r"written in place.* discarded.*pass modify=True"):
        with tierflow.gathered(model):
            _halve_norm_weights(model)
    assert _released(model)
    assert torch.equal(model.state_dict()["transformer.ln_f.weight"], read)
    assert _steps(task, model, opt, 1, 1, device) == want_losses


def test_gathered_inside_the_forward_or_backward_is_refused(device):
    _emulated_only(device)
    task = _task()
    model, opt = _wrapped(task, device, "host", "")
    where = []

    def in_forward(module, args):
        with pytest.raises(tierflow.ConfigError, match=r"tierflow\.gathered: inside GPT2LMHeadModel's forward.*"
                                                       r"outside the forward and backward"):
            with tierflow.gathered(model.lm_head):
                pass
        where.append("forward")

    handle = model.transformer.h[2].register_forward_pre_hook(in_forward)
    loss = task.loss(model, task.batch_on(0, device))
    handle.remove()

    def in_backward(grad):
        with pytest.raises(tierflow.ConfigError, match=r"inside GPT2LMHeadModel's backward"):
            with tierflow.gathered(model.transformer.h[0]):
                pass
        where.append("backward")

    loss.register_hook(in_backward)
    loss.backward()
    assert where == ["forward", "backward"]
    opt.step()


def test_evaluation_inside_gathered_works_and_training_is_refused(device):
    """A forward under no_grad inside gathered() (evaluation, generation: DeepSpeed-Chat gathers for it) reads the
    gathered values; a forward that builds a graph and an optimizer step are refused (the step would update the
    host copies behind the block), and training goes on as the baseline's."""
    _emulated_only(device)
    task = _task()

    def run(model, opt, inside) -> list:
        out = _steps(task, model, opt, 0, 1, device)
        loss = task.loss(model, task.batch_on(1, device))
        loss.backward()
        out.append(loss.item())
        with inside(model):
            with torch.no_grad():
                out.append(task.loss(model, task.batch_on(9, device)).item())
            if inside is tierflow.gathered:
                with pytest.raises(tierflow.ConfigError, match=r"a forward of GPT2LMHeadModel that builds a graph "
                                                               r".*inside a gathered\(\) block.*torch\.no_grad"):
                    task.loss(model, task.batch_on(1, device))
                with pytest.raises(tierflow.ConfigError, match=r"AdamW\.step\(\) inside a gathered\(\) block.*"
                                                               r"step outside the block"):
                    opt.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out + _steps(task, model, opt, 2, 1, device)

    want = run(*_plain(task, device), inside=lambda m: contextlib.nullcontext())
    assert run(*_wrapped(task, device, "host", ""), inside=tierflow.gathered) == want


def test_gathering_more_than_the_budget_is_refused_saying_gather_fewer(device):
    _emulated_only(device)
    task = _task()
    model, opt = _plain(task, device)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model, opt = tierflow.wrap(model, opt, device=device, offload_params="host", gpu_memory=str(total // 2),
                               **OPT_NONE)
    _steps(task, model, opt, 0, 1, device)
    with pytest.raises(tierflow.OutOfMemoryError,
                       match=r"parameter '[\w.]+' .*TIERFLOW_GPU_MEMORY.*gather fewer modules at a time"):
        with tierflow.gathered(model):
            pass
    assert _released(model)
    for block in model.transformer.h:  # one block at a time fits
        with tierflow.gathered(block):
            pass
    _steps(task, model, opt, 1, 1, device)


# -- model.to() and friends after wrap --------------------------------------------------------------------------

@pytest.mark.parametrize("tier", TIERS)
def test_a_real_conversion_after_wrap_is_refused_and_the_model_still_trains(device, tier, nvme_dir):
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    want = _steps(task, plain, plain_opt, 0, 2, device)
    model, opt = _wrapped(task, device, tier, nvme_dir)
    _steps(task, model, opt, 0, 1, device)
    before = [(p, p.dtype) for p in model.parameters()]
    buffers = [(b, b.dtype) for b in model.buffers()]
    calls = {
        "half": lambda m: m.half(),
        "bfloat16": lambda m: m.bfloat16(),
        "to": lambda m: m.to(torch.float16),
        "double": lambda m: m.double(),
        "to_empty": lambda m: m.to_empty(device=device if device != "emulated" else "cpu"),
    }
    for call, convert in calls.items():
        for target in (model, model.transformer.h[1]):  # the model, or one of its blocks
            with pytest.raises(tierflow.ConfigError, match=rf"\.{call}\(\) after tierflow\.wrap would make parameter "
                               rf"'.*' \(torch\.float32 on cpu\).* lives on the {tier} between uses.*"
                               rf"TIERFLOW_OFFLOAD_PARAMS={tier}.*call \.{call}\(\) before tierflow\.wrap, or "
                               r"tierflow\.unwrap\(model\) first.*Nothing was changed"):
                convert(target)
    assert [(p, p.dtype) for p in model.parameters()] == before
    assert [(b, b.dtype) for b in model.buffers()] == buffers  # nothing converted before the refusal
    assert _steps(task, model, opt, 1, 1, device) == want[1:]
    tierflow.unwrap(model)
    assert model.half() is model and all(p.dtype == torch.float16 for p in model.parameters())


@pytest.mark.parametrize("overwrite", [False, True])  # torch.__future__'s new Parameter objects on conversion
@pytest.mark.parametrize("tier", TIERS)
def test_a_conversion_that_changes_nothing_works_after_wrap(device, tier, nvme_dir, overwrite):
    _emulated_only(device)
    task = _task()
    plain, plain_opt = _plain(task, device)
    want = _steps(task, plain, plain_opt, 0, 3, device)
    model, opt = _wrapped(task, device, tier, nvme_dir)
    _steps(task, model, opt, 0, 1, device)
    params = list(model.parameters())
    was = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    try:
        same = torch.device("cpu") if device == "emulated" else torch.device(device)
        # What HF Trainer and accelerate call again on a model already in place.
        assert model.to(same) is model and model.to(same, torch.float32) is model
        assert model.float() is model and model.cpu() is model and model.type(torch.float32) is model
        model.transformer.h[0].to(same)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(was)
    assert list(model.parameters()) == params and _released(model)
    assert _steps(task, model, opt, 1, 2, device) == want[1:]
    _assert_equal(_values(model), _values(plain))


def test_deepcopy_of_a_wrapped_model_is_refused_by_name(device):
    """copy.deepcopy of a wrapped model (TRL's reference model, an EMA copy) is refused, saying to copy before
    wrap: the copy's hooks would drive the original's runtime (before: TypeError, cannot pickle the runtime)."""
    _emulated_only(device)
    import copy

    task = _task()
    model, opt = _wrapped(task, device, "host", None)
    with pytest.raises(tierflow.ConfigError, match=r"copy\.deepcopy .*before tierflow\.wrap"):
        copy.deepcopy(model)
    _steps(task, model, opt, 0, 1, device)  # trains on
