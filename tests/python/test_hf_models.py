"""Hugging Face transformers models with their default configs under tierflow (Note [HF caches] in _hf.py).

Tiny GPT-2 and Llama configs are built in-process (nothing is downloaded); everything else is as shipped:
``use_cache=True``, GPT-2's dropouts at 0.1, SDPA attention. Under the default settings
(offload_activations=auto: two profiling steps that recompute every block, then the plan) they train
bit-identical to the baseline with offload_optimizer="none", and within the CPU optimizer's rounding of
torch.optim.AdamW with the default offload_optimizer="host".
"""

import json
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")

import tierflow  # noqa: E402
from harness import (Task, assert_bit_identical, assert_close, subprocess_environment, torch_device,  # noqa: E402
                     train)
from children import run_child  # noqa: E402

# The families' code differs between transformers versions: these run again under transformers 5
# (Note [Test tiers]).
pytestmark = pytest.mark.transformers

VOCAB, SEQ, BATCH = 128, 32, 4


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                                                n_positions=64))


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64))


MODELS = {"gpt2": (_gpt2, "GPT2LMHeadModel", "GPT2Block"), "llama": (_llama, "LlamaForCausalLM", "LlamaDecoderLayer")}


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5000 + i))


def hf_task(name: str) -> Task:
    # The model is called as a training loop calls it: no use_cache argument, so config.use_cache decides.
    return Task(MODELS[name][0], lambda i: (_ids(i),), lambda m, b: m(input_ids=b[0], labels=b[0]).loss)


@pytest.fixture(autouse=True)
def _quiet_wrap_warning():
    """The use_cache warning is the subject of one test; the others expect it and need not see it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tierflow.wrap: .* has config.use_cache=True")
        yield


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_config_trains_bit_identical_under_default_settings(device, name):
    task = hf_task(name)
    assert task.make_model().config.use_cache is True  # the default config, as shipped
    base = train(task, 4, False, device=device)
    tier = train(task, 4, True, device=device, offload_optimizer="none")
    assert_bit_identical(base, tier)
    plan = tier.report["plan"]
    # The two profiling steps replayed every block (where the cache used to break the replay).
    assert plan["blocks"] == 2 and plan["replays"] == 2 * 2, plan


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_config_matches_torch_adamw_with_the_cpu_optimizer(device, name):
    task = hf_task(name)
    base = train(task, 4, False, device=device)
    tier = train(task, 4, True, device=device)
    assert_close(base, tier)
    assert tier.report["optimizer"]["steps"] >= 4


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_under_a_tight_budget_offloads_and_matches_the_baseline(tmp_path, device, name):
    # A profile from a run with room, edited to a link that moves 60% of a block's saved bytes while it
    # computes (as in test_plans.py), then a run whose budget is the floor's peak: the plan must recompute
    # blocks in backward (recompute, or split where the link helps) and the run stay the baseline's, bit for bit.
    # GPT-2's attention dropout (attn_pdrop=0.1) runs in a flash/efficient SDPA kernel on CUDA: its split replay
    # reruns that attention op (it draws from the generator) rather than restoring it (Note [Activation plans]).
    task = hf_task(name)
    path = str(tmp_path / "profile.json")
    settings = dict(offload_optimizer="none", min_offload_bytes=0, prefetch_bytes="256KiB")
    measured = train(task, 3, True, device=device, profile=path, **settings)
    with open(path) as f:
        profile = json.load(f)
    b = profile["blocks"][0]
    # The blocks are alike; their measured times are not on a loaded machine (a block measured slower
    # hides more of the link and may be planned to swap). The planner sees block 0's times for each.
    timing = ("forward_seconds", "backward_seconds", "split_recompute_seconds", "cheap_recompute_seconds")
    for other in profile["blocks"][1:]:
        other.update({k: b[k] for k in timing})
    bandwidth = (b["input_bytes"] + b["whole_bytes"] + b["split_bytes"]) / b["forward_seconds"] * 0.6
    profile["links"].update(d2h=bandwidth, h2d=bandwidth, duplex=2 * bandwidth, compute_share_during_copies=1.0)
    with open(path, "w") as f:
        json.dump(profile, f)
    budgets = measured.session.planner.budgets(profile)
    floor = tierflow.activations.plans.plan(profile["blocks"], profile["links"], budgets, mode="recompute")
    base = train(task, 3, False, device=device)
    tier = train(task, 3, True, device=device, profile=path, gpu_memory=str(floor["predicted_device_peak_bytes"]),
                 **settings)
    assert_bit_identical(base, tier)
    plan = tier.report["plan"]
    assert all(m in ("recompute", "split") for m in plan["modes"]), plan
    assert plan["replays"] == 3 * 2, plan


@pytest.mark.parametrize("name", sorted(MODELS))
def test_use_cache_is_turned_off_for_training_with_one_warning(device, name):
    make, cls, _ = MODELS[name]
    task = hf_task(name)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tier = train(task, 3, True, device=device, offload_optimizer="none")
    ours = [w for w in seen if "use_cache" in str(w.message) and "tierflow" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert cls in message and "model.config.use_cache = False" in message, message
    assert ours[0].filename == __file__.replace("test_hf_models.py", "harness.py"), ours[0].filename
    assert tier.losses

    # A model whose config already says use_cache=False is left alone, and no warning is given.
    torch.manual_seed(0)
    model = make().to(torch_device(device))
    model.config.use_cache = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tierflow.wrap(model, None, device=device, offload_optimizer="none")
    assert not [w for w in seen if "tierflow" in str(w.message)], [str(w.message) for w in seen]


def _wrapped(name: str, device: str, **settings):
    torch.manual_seed(0)
    model = MODELS[name][0]().to(torch_device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierflow.wrap(model, opt, device=device, **settings)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_cache_passed_in_training_is_refused_naming_the_block(device, name):
    _, _, block = MODELS[name]
    model, opt = _wrapped(name, device, offload_optimizer="none")
    x = _ids(0).to(torch_device(device))
    with pytest.raises(tierflow.TierflowError,
                       match=rf"block 0 \({block}\) was called with past_key_values=DynamicCache .*profiling.*"
                             r"use_cache=True.*offload_activations='host'"):
        model(input_ids=x, labels=x, use_cache=True)
    with pytest.raises(tierflow.TierflowError, match=rf"block 0 \({block}\) was called with past_key_values="):
        model(input_ids=x, labels=x, past_key_values=transformers.DynamicCache())
    # Nothing was left half-done: training goes on, and a plan is made after the profiling steps.
    for step in range(3):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    assert tierflow.report()["plan"]["modes"] == ["keep", "keep"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_cache_passed_in_training_is_right_where_nothing_is_replayed(device, name):
    # offload_activations="host" swaps saved tensors and replays nothing: an explicit cache trains as in torch.
    def run(use_tierflow: bool) -> list:
        torch.manual_seed(0)
        model = MODELS[name][0]().to(torch_device(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if use_tierflow:
            model, opt = tierflow.wrap(model, opt, device=device, offload_activations="host",
                                       offload_optimizer="none", min_offload_bytes=0)
        losses = []
        for step in range(2):
            x = _ids(step).to(torch_device(device))
            out = model(input_ids=x, labels=x, use_cache=True)
            assert out.past_key_values.get_seq_length() == SEQ
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        return losses

    assert run(True) == run(False)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inference_keeps_the_cache_after_training(device, name):
    dev = torch_device(device)
    model, opt = _wrapped(name, device, offload_optimizer="none")
    for step in range(3):  # past the profiling steps: the plan is in force
        x = _ids(step).to(dev)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    reference = MODELS[name][0]().to(dev)  # the same weights, never wrapped
    reference.load_state_dict(model.state_dict())
    model.eval()
    reference.eval()
    prompt = _ids(9)[:, :8].to(dev)
    with torch.no_grad():
        out, ref = model(input_ids=prompt), reference(input_ids=prompt)  # config.use_cache is untouched
        assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 8
        assert torch.equal(out.logits, ref.logits)
        step = model(input_ids=prompt[:, -1:].clone(), past_key_values=out.past_key_values)
        assert step.past_key_values.get_seq_length() == 9
    # eval() with grad enabled: the model's own choice, a cache, too.
    assert model(input_ids=prompt).past_key_values is not None
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
    # Back to training: the cache is off again.
    model.train()
    x = _ids(3).to(dev)
    out = model(input_ids=x, labels=x)
    assert out.past_key_values is None
    out.loss.backward()


def test_tierflow_does_not_import_transformers():
    code = ("import sys, torch, tierflow\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n"
            "m, _ = tierflow.wrap(m, torch.optim.AdamW(m.parameters()), device='emulated')\n"
            "m(torch.randn(2, 8)).sum().backward()\n"
            "print('transformers' in sys.modules)\n")
    done = run_child([sys.executable, "-c", code], env=subprocess_environment(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout
