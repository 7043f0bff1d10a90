"""Parameters on the host or NVMe between uses (TIERFLOW_OFFLOAD_PARAMS=host|nvme, issue 18; Note [Parameter hooks]).

Correctness is the baseline's: the same model, data and seed without tierflow, bit for bit with a torch optimizer
(offload_optimizer="none", which on the emulated device steps the host copies in place) under every activation
mode; with tierflow's CPU optimizer, bit for bit the same CPU optimizer run without parameter offload. The model
zoo's families (nobody here wrote them) with their default configs, and a model whose parameters are four times
TIERFLOW_GPU_MEMORY, whose device peak of parameter bytes (the report's) stays within it.
"""

from __future__ import annotations

import gc
import warnings
from typing import Optional

import pytest
import torch

import tierflow
from harness import Task, assert_bit_identical, train

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")

from test_model_zoo import STEPS, ZOO, baseline  # noqa: E402  (the zoo's families, built the zoo's way)

OPT_NONE = dict(offload_optimizer="none", min_offload_bytes=0)
VOCAB = 96


@pytest.fixture(autouse=True)
def _quiet_wrap_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tierflow.wrap: .* has config.use_cache=True")
        yield


def _emulated_only(device: str) -> None:
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device; on CUDA it is refused "
                    "(test_torch_optimizer_refusal_text) and the CPU optimizer tests cover CUDA")


# Under transformers 5 (Note [Test tiers]) once per family, with the planner: the families' code paths.
@pytest.mark.parametrize("acts", ["none", pytest.param("auto", marks=pytest.mark.transformers), "recompute"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_with_parameters_on_the_host_is_bit_identical_to_the_baseline(device, name, acts):
    _emulated_only(device)
    run = train(ZOO[name][0](), STEPS, True, device=device, offload_activations=acts, offload_params="host",
                **OPT_NONE)
    assert_bit_identical(run, baseline(name, device))
    p = run.report["params"]
    assert p["fetches"] > 0 and p["releases"] > 0 and p["device_bytes"] == 0, p  # all released after each step
    assert p["host_bytes"] == _parameter_bytes(ZOO[name][0]()), p  # every parameter lives on the host


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "gpt2_lora"])
def test_zoo_with_parameters_on_nvme_is_bit_identical_to_the_baseline(device, name, nvme_dir):
    _emulated_only(device)
    run = train(ZOO[name][0](), STEPS, True, device=device, offload_activations="none", offload_params="nvme",
                nvme_paths=[nvme_dir], **OPT_NONE)
    assert_bit_identical(run, baseline(name, device))
    p = run.report["params"]
    assert p["nvme_bytes"] == _parameter_bytes(ZOO[name][0]()) and p["host_bytes"] == 0, p
    assert p["nvme_to_host_bytes"] == p["host_to_device_bytes"] > 0 and p["device_bytes"] == 0, p


def _deep(kind: str, layers: int = 16, width: int = 128) -> Task:
    """A zoo family made deep and wide enough that its parameters are most of what training holds (1 x 8 tokens)."""
    def make():
        if kind == "gpt2":
            return transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=layers, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=64))
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64))

    def batch(i: int) -> tuple:
        return (torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(9000 + i)),)

    return Task(make, batch, lambda m, b: m(input_ids=b[0], labels=b[0]).loss)


def _parameter_bytes(task: Task) -> int:
    return sum(p.numel() * p.element_size() for p in task.make_model().parameters())


def _resident_and_budget(task: Task, steps: int, device: str, params_share: float, placed: Optional[dict] = None,
                         **settings) -> tuple:
    """The run with every parameter on the device, and a device budget with room for `params_share` of the
    parameters. On the emulated device that share is the budget (nothing else is counted there). On CUDA the
    process holds more (cuBLAS's workspace, the logits, what earlier tests left allocated): a first run with the
    parameters placed as the test places them (`placed`; default TIERFLOW_OFFLOAD_PARAMS=auto) measures what the
    rest of training holds (its profile's fixed_device_bytes, Note [Auto plan phases]), and the budget is that,
    the largest block's working set and the prefetch window, and the share."""
    total = _parameter_bytes(task)
    resident = train(task, steps, True, device=device, **settings)
    if device != "cuda":
        return resident, int(total * params_share)
    probe = train(task, 3, True, device=device, **(placed or dict(offload_params="auto")), **settings)
    profile = probe.session.planner.profile
    del probe  # its session's device buffers go with it (train() collects cycles before the next run)
    largest = max(b["input_bytes"] + b["whole_bytes"] + b["split_bytes"] + b["cheap_bytes"] + b["transient_bytes"]
                  for b in profile["blocks"])
    window = min(int(settings.get("prefetch_bytes", 0)), sum(
        b["input_bytes"] + b["whole_bytes"] + b["split_bytes"] + b["cheap_bytes"] for b in profile["blocks"]))
    return resident, profile["fixed_device_bytes"] + largest + window + int(total * params_share)


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_parameters_four_times_the_device_budget_train_within_it(device, kind, tier, nvme_dir):
    """The issue's CI target: parameters 4x TIERFLOW_GPU_MEMORY, with everything offloaded (CPU optimizer,
    gradients freed on the host, activations planned by auto within the budget); bit-identical to the same CPU
    optimizer run with the parameters on the device, and the report's device peak of parameter bytes within
    the budget."""
    task = _deep(kind)
    common = dict(offload_gradients="on", prefetch_bytes=256 << 10)
    placed = dict(offload_params=tier, nvme_paths=[nvme_dir]) if tier == "nvme" else dict(offload_params=tier)
    resident, budget = _resident_and_budget(task, STEPS, device, 1 / 4, placed, **common)
    offloaded = train(task, STEPS, True, device=device, gpu_memory=str(budget), **placed, **common)
    assert_bit_identical(offloaded, resident)
    p = offloaded.report["params"]
    assert 0 < p["device_peak_bytes"] <= min(budget, _parameter_bytes(task) // 4), (p, budget)
    assert p[f"{tier}_bytes"] == _parameter_bytes(task), p
    assert p["prefetch_hits"] > 0 and p["host_to_device_bytes"] >= 2 * STEPS * _parameter_bytes(task), p
    if tier == "nvme":  # every fetch read its parameter from NVMe first
        assert p["nvme_to_host_bytes"] == p["host_to_device_bytes"], p
    plan = offloaded.report["plan"]
    assert plan["predicted_device_peak_bytes"] <= budget, plan["summary"]
    if device == "emulated":  # and the torch optimizer stepping the host copies, bit for bit the baseline's
        run = train(task, STEPS, True, device=device, offload_activations="none", gpu_memory=str(budget), **placed,
                    **OPT_NONE)
        assert_bit_identical(run, train(task, STEPS, False, device=device))
        assert run.report["params"]["device_peak_bytes"] <= budget


@pytest.mark.parametrize("tier,acts", [("host", "auto"), ("host", "host"), ("nvme", "auto")])
def test_cpu_optimizer_steps_the_offloaded_parameters_bit_identically(device, tier, acts, nvme_dir):
    """The default CPU optimizer: on the host tier its steps during backward commit their weights into the host
    copies; on NVMe those parameters step in step() and are written there."""
    task = ZOO["llama"][0]()
    offloaded = train(task, STEPS, True, device=device, offload_activations=acts, offload_params=tier,
                      nvme_paths=[nvme_dir], min_offload_bytes=0)
    resident = train(task, STEPS, True, device=device, offload_activations=acts, min_offload_bytes=0)
    assert_bit_identical(offloaded, resident)
    streaming = offloaded.report["optimizer"].get("streaming") or {}
    if tier == "host":
        assert offloaded.report["optimizer"]["overlap"] == resident.report["optimizer"]["overlap"]
        if streaming:  # weights committed into the host copies, none sent to the device
            assert streaming["weight_bytes_to_host_copy"] > 0 and streaming["weight_bytes_to_device"] == 0, \
                streaming
    else:
        assert offloaded.report["optimizer"]["overlap"]["early_steps"] == 0


def _wrapped(task: Task, device: str, **settings):
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return tierflow.wrap(model, opt, device=device, offload_params="host", **settings)


def _step(task: Task, model, opt, i: int, device: str) -> float:
    loss = task.loss(model, task.batch_on(i, device))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def test_state_dict_load_state_dict_and_unwrap_go_through_the_host_copies(device):
    _emulated_only(device)
    task = ZOO["gpt2"][0]()
    base = train(task, 2, False, device=device)
    model, opt = _wrapped(task, device, **OPT_NONE)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()  # dropout's
    losses = [_step(task, model, opt, i, device) for i in range(2)]
    assert losses == base.losses
    saved = model.state_dict()
    for k, v in base.params.items():
        assert torch.equal(saved[k], v), k
    # Loading the start back and training again gives the same two steps (the optimizer starts again too).
    model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    torch.set_rng_state(rng)
    assert [_step(task, model, opt, i, device) for i in range(2)] == base.losses
    # unwrap: every parameter has its device memory and its trained value back.
    tierflow.unwrap(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, base.params[k]), k
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


def test_an_optimizer_made_after_wrap_and_an_eval_forward_work(device):
    _emulated_only(device)
    task = ZOO["llama"][0]()
    base = train(task, STEPS, False, device=device)
    torch.manual_seed(0)
    model, _ = tierflow.wrap(task.model_on(device), None, device=device, offload_params="host", **OPT_NONE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for i in range(STEPS):
        losses.append(_step(task, model, opt, i, device))
        with torch.no_grad():  # an evaluation between steps: fetched and released like any forward
            model.eval()
            task.loss(model, task.batch_on(i, device))
            model.train()
    assert losses == base.losses
    assert tierflow.report()["params"]["device_bytes"] == 0


@pytest.mark.parametrize("reentrant", [None, False])  # None: HF's default (torch.utils.checkpoint, reentrant)
@pytest.mark.transformers
def test_hf_gradient_checkpointing_recomputes_with_the_parameters_fetched(device, reentrant):
    _emulated_only(device)
    task = ZOO["gpt2"][0]()

    def make():
        m = task.make_model()
        m.gradient_checkpointing_enable(
            **({} if reentrant is None else dict(gradient_checkpointing_kwargs={"use_reentrant": reentrant})))
        return m

    ckpt = Task(make, task.make_batch, task.loss)
    run = train(ckpt, STEPS, True, device=device, offload_params="host", offload_activations="none", **OPT_NONE)
    assert_bit_identical(run, train(ckpt, STEPS, False, device=device))


def _refused_leaving_the_model_as_it_was(device: str, error: type, match: str, **settings) -> None:
    """wrap raises ``error`` matching ``match``, and the model keeps its parameters, values and no session."""
    task = _deep("gpt2", layers=4)
    torch.manual_seed(0)
    model = task.model_on(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        tierflow.wrap(model, None, device=device, **settings)
    assert getattr(model, "_tierflow_session", None) is None
    for k, v in model.state_dict().items():  # nothing was released
        assert torch.equal(v, before[k]), k


def test_a_budget_below_a_block_and_its_window_is_refused_and_changes_nothing(device):
    _refused_leaving_the_model_as_it_was(
        device, tierflow.OutOfMemoryError, r"parameters fetched from the host or NVMe need at least \d+ bytes.*"
        r"TIERFLOW_GPU_MEMORY\) is 1000 bytes", offload_params="host", gpu_memory="1000")


def test_nvme_space_is_checked_before_the_first_write(device, nvme_dir):
    import os

    _refused_leaving_the_model_as_it_was(
        device, tierflow.OutOfMemoryError, r"the parameters need \d+ bytes .* on NVMe and the NVMe tier has .* "
        r"available", offload_params="nvme", nvme_paths=[nvme_dir], nvme_memory="1MiB")
    gc.collect()
    assert [f for f in os.listdir(nvme_dir) if f.startswith("tierflow")] == []  # no swap file left behind


def test_settings_and_models_it_cannot_serve_are_refused(device):
    task = ZOO["gpt2"][0]()
    with pytest.raises(tierflow.ConfigError, match="TIERFLOW_GPU_OPTIMIZER_FRACTION=0.5.*accepted"):
        tierflow.wrap(task.model_on(device), None, device=device, offload_params="host", gpu_optimizer_fraction="0.5")
    with pytest.raises(tierflow.ConfigError, match="TIERFLOW_OFFLOAD_PARAMS='auto' with TIERFLOW_OFFLOAD_ACTIVATIONS"
                                                   "='none'.*accepted: TIERFLOW_OFFLOAD_ACTIVATIONS=auto"):
        tierflow.wrap(task.model_on(device), None, device=device, offload_params="auto", offload_activations="none")
    with pytest.raises(tierflow.ConfigError, match="TIERFLOW_OFFLOAD_PARAMS='nvme' needs TIERFLOW_NVME_PATHS"):
        tierflow.wrap(task.model_on(device), None, device=device, offload_params="nvme")
    with pytest.raises(tierflow.ConfigError, match="found no repeated blocks in Linear.*blocks="):
        tierflow.wrap(torch.nn.Linear(4, 4).to(task.model_on(device).lm_head.weight.device), None, device=device,
                      offload_params="host")

    class Flat(torch.nn.Module):  # two blocks whose weights are views of one flat buffer
        def __init__(self) -> None:
            super().__init__()
            # Made on the device: Module.to() would give each view a storage of its own there.
            flat = torch.zeros(32, device=task.model_on(device).lm_head.weight.device)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(2))
            for i, b in enumerate(self.blocks):
                b.weight = torch.nn.Parameter(flat[16 * i:16 * (i + 1)].view(4, 4))

    with pytest.raises(tierflow.ConfigError, match="parameter 'blocks.0.weight' is not a contiguous tensor with a "
                                                   "storage of its own"):
        tierflow.wrap(Flat(), None, device=device, offload_params="host")
    gc.collect()


def test_torch_optimizer_refusal_text():
    """On CUDA a torch optimizer over host-resident parameters is refused at its step (the text; the C++ test
    covers the rule itself on both devices)."""
    rt = tierflow._C.Runtime({"TIERFLOW_OFFLOAD_PARAMS": "host", "TIERFLOW_DEVICE": "emulated"})
    assert rt.params_optimizer_refusal(False) is None  # the emulated device steps the host copies
    assert rt.params_optimizer_refusal(True) is None


@pytest.mark.ordering
def test_ddp_with_parameters_on_the_host_is_refused_in_both_orders(world_of_one):
    """DDP reads and all-reduces the parameters themselves (issue 21 has DDP with parameter offload)."""
    task = ZOO["gpt2"][0]()
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(task.model_on("emulated"))
    with pytest.raises(tierflow.ConfigError, match="OFFLOAD_PARAMS \\(host or nvme\\) under .*DistributedDataParallel.*"
                                                   "accepted under DDP: TIERFLOW_OFFLOAD_PARAMS=none"):
        tierflow.wrap(ddp, None, device="emulated", offload_params="host")
    assert all(p.untyped_storage().nbytes() > 0 for p in ddp.parameters())  # nothing was released
    model = task.model_on("emulated")
    around = torch.nn.parallel.DistributedDataParallel(model)  # then the model inside it is wrapped
    tierflow.wrap(model, None, device="emulated", offload_params="host", offload_activations="none")
    with pytest.raises(tierflow.ConfigError, match="under .*DistributedDataParallel"):
        task.loss(around, task.batch_on(0, "emulated"))


@pytest.mark.parametrize("room", ["tight", "ample"])
def test_auto_plans_which_blocks_keep_their_parameters(device, room):
    """TIERFLOW_OFFLOAD_PARAMS=auto: two steps with every unit fetched, then the plan's residences. Under a budget
    of half the parameters some units are fetched and the device peak stays within it; with room for all, every
    unit stays resident and nothing is fetched after the plan. Bit for bit the same CPU optimizer run without
    parameter offload either way."""
    task = _deep("llama", layers=8)
    total = _parameter_bytes(task)
    common = dict(offload_gradients="on", prefetch_bytes=256 << 10)
    steps = 5
    resident, budget = _resident_and_budget(task, steps, device, 1 / 2 if room == "tight" else 64, **common)
    offloaded = train(task, steps, True, device=device, offload_params="auto", gpu_memory=str(budget), **common)
    assert_bit_identical(offloaded, resident)
    p, plan = offloaded.report["params"], offloaded.report["plan"]
    fetched = plan["params"] + [plan["rest_params"]]
    assert plan["predicted_device_peak_bytes"] <= budget, plan["summary"]
    if room == "tight":
        assert "host" in fetched and p["device_peak_bytes"] <= budget, (fetched, p)
        assert p["host_bytes"] > 0, p
    else:
        assert set(fetched) == {"gpu"}, plan["summary"]
        assert p["host_bytes"] == 0 and p["device_bytes"] == total, p  # all resident from the third step on


@pytest.mark.transformers
def test_generate_with_parameters_on_the_host_matches_the_model_without(device):
    """generate(): many no_grad forwards with a KV cache, each fetching and releasing every unit."""
    task = ZOO["llama"][0]()
    ids = task.batch_on(0, device)[0][:1]
    torch.manual_seed(0)
    expected = task.model_on(device).eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                                     do_sample=False, pad_token_id=0)
    torch.manual_seed(0)
    model, _ = tierflow.wrap(task.model_on(device), None, device=device, offload_params="host", **OPT_NONE)
    got = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                pad_token_id=0)
    assert torch.equal(got, expected)
    p = tierflow.report()["params"]
    n = len(list(model.parameters()))
    assert p["device_bytes"] == 0 and p["fetches"] == p["releases"] == 6 * n, (p, n)  # each forward: each once


def test_the_cpu_optimizer_steps_the_model_on_the_device_again_after_unwrap(device):
    task = ZOO["llama"][0]()

    def run(**settings) -> dict:
        torch.manual_seed(0)
        model = task.model_on(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        model, opt = tierflow.wrap(model, opt, device=device, **settings)
        for i in range(2):
            _step(task, model, opt, i, device)
        tierflow.unwrap(model)
        _step(task, model, opt, 2, device)  # the CPUAdamW wrap returned goes on stepping the model
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    offloaded, resident = run(offload_params="host"), run()
    for k, v in resident.items():
        assert torch.equal(offloaded[k], v), k


def test_a_failed_fetch_leaves_a_model_that_trains(device, nvme_dir):
    """An NVMe read error while fetching: that forward raises; the next steps train as if it had not happened.
    On the emulated device a torch AdamW steps the host copies (the baseline without tierflow); on CUDA, where that
    is refused, tierflow's CPU AdamW does (the baseline: the same optimizer with the parameters on the device)."""
    task = ZOO["llama"][0]()
    emulated = device == "emulated"
    base = train(task, STEPS, not emulated, device=device)
    faults = tierflow._C.NvmeFaults()
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = tierflow.wrap(model, opt, device=device, offload_params="nvme", nvme_paths=[nvme_dir],
                               _nvme_faults=faults, **(OPT_NONE if emulated else {}))
    faults.fail_reads = 1
    with pytest.raises(OSError, match="read of .* failed"):
        task.loss(model, task.batch_on(0, device))
    assert [_step(task, model, opt, i, device) for i in range(STEPS)] == base.losses


def test_double_backward_is_refused(device):
    task = ZOO["llama"][0]()
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = tierflow.wrap(model, opt, device=device, offload_params="host", offload_activations="none")
    weight = model.model.layers[0].mlp.up_proj.weight
    loss = task.loss(model, task.batch_on(0, device))
    with pytest.raises(tierflow.ConfigError, match="create_graph=True.*accepted: TIERFLOW_OFFLOAD_PARAMS=none"):
        torch.autograd.grad(loss, weight, create_graph=True)
    # The model trains on after the refusal.
    before = weight._version
    _step(task, model, opt, 0, device)
    assert weight._version > before  # the step wrote the host copy: the version moved as torch's in-place step's
