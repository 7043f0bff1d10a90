"""``python -m tierflow plan --model``'s estimate (Note [Model families]) against what a run under tierflow.wrap
measures, for a tiny config of each zoo family (2 layers, hidden 64, fp32, on the emulated device).

Device: the bytes the plan holds with every block kept (parameters, gradients, every block's saved activations and
what is saved outside the blocks) against the parameters' and gradients' bytes of the run's model and the saved
activations' peak tierflow measured (report()["activations"]["device_bytes"]["peak"] under offload_activations
"none": every saved tensor counted by its hooks). Host: the CPU AdamW's states the plan puts in the pinned host
pool against report()["optimizer"]["states"]["bytes"]. Each within 10% (the errors are printed: pytest -s).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")

import tierflow  # noqa: E402
from tierflow import _C  # noqa: E402
from harness import torch_device  # noqa: E402

VOCAB, SEQ, BATCH = 128, 32, 4
DENSE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
MOE = dict(DENSE, num_experts_per_tok=2)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**DENSE),
    "mistral": lambda: transformers.MistralConfig(**DENSE),
    "qwen2": lambda: transformers.Qwen2Config(**DENSE),
    "qwen3": lambda: transformers.Qwen3Config(**DENSE, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**DENSE, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**DENSE, pad_token_id=0),
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "mixtral": lambda: transformers.MixtralConfig(**MOE, num_local_experts=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**dict(MOE, moe_intermediate_size=32), num_experts=4),
}


def _estimate(config) -> dict:
    """What the plan command estimates for this config.json (the same C++ it calls)."""
    text = json.dumps(config.to_dict())
    model = _C.parse_model_config(text, "config.json")
    shape = model.shape
    shape.seq, shape.batch, shape.dtype_bytes = SEQ, BATCH, 4
    blocks = _C.estimate_transformer(shape, 1e12)
    state = _C.estimate_training_state(shape, "host", "fp32")
    saved = sum(b.input_bytes + b.whole_bytes + b.split_bytes + b.cheap_bytes for b in blocks)
    return {"model_type": model.model_type, "parameters": _C.transformer_parameters(shape),
            "device": state.device + saved + _C.estimate_head_saved_bytes(shape), "host": state.host}


def _measure(config, device: str) -> dict:
    """One training step under tierflow.wrap, everything kept on the device, the CPU AdamW on the host."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch_device(device))
    model.config.use_cache = False
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device,
                               offload_activations="none", offload_optimizer="host", min_offload_bytes=0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(torch_device(device))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    report = tierflow.report()
    return {"parameters": params,
            "device": 2 * param_bytes + report["activations"]["device_bytes"]["peak"],  # parameters, gradients
            "host": report["optimizer"]["states"]["bytes"]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_predicted_device_and_host_bytes_are_within_10_percent_of_a_run(device, family):
    config = FAMILIES[family]()
    predicted, measured = _estimate(config), _measure(config, device)
    assert predicted["model_type"] == config.model_type
    assert predicted["parameters"] == measured["parameters"]  # every weight, the tied head once
    errors = {k: predicted[k] / measured[k] - 1 for k in ("device", "host")}
    print(f"{family}: device {predicted['device']} predicted, {measured['device']} measured ({errors['device']:+.1%});"
          f" host {predicted['host']} predicted, {measured['host']} measured ({errors['host']:+.1%})")
    for k, e in errors.items():
        assert abs(e) <= 0.10, (family, k, predicted[k], measured[k])


def _plan_pinned_host_bytes(config, optimizer: str) -> tuple[int, int]:
    """The pinned host bytes the plan command takes out of the host budget for the CPU AdamW (its bytes-per-tier
    row and fit search use the same figure: optimizer_pinned_bytes), and the states' host bytes."""
    shape = _C.parse_model_config(json.dumps(config.to_dict()), "config.json").shape
    shape.seq, shape.batch, shape.dtype_bytes = SEQ, BATCH, 4
    inputs = _C.PlanCommandInputs(
        host_memory=_C.SettingText(text="1GiB", source=_C.SettingSource.flag),
        prefetch=_C.SettingText(text="1MiB", source=_C.SettingSource.flag), host_capacity_bytes=2 ** 40,
        device_capacity_bytes=2 ** 40, optimizer=optimizer, shape=shape,
        state=_C.estimate_training_state(shape, optimizer, "fp32"), blocks_from="config.json")
    return _C.plan_command_budgets(inputs).optimizer_host_bytes, inputs.state.host


def _wrap_refuses(config, device: str, optimizer: str, host_bytes: int, nvme_dir: str) -> bool:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch_device(device))
    try:
        tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=device,
                      offload_optimizer=optimizer, host_memory=str(host_bytes), nvme_paths=nvme_dir)
    except Exception as e:  # tierflow's OutOfMemoryError
        assert "pinned host memory" in str(e) and "OutOfMemoryError" in type(e).__name__, e
        return True
    return False


@pytest.mark.parametrize("family,optimizer,exact", [("llama", "host", True), ("llama", "nvme", True),
                                                    ("mixtral", "nvme", True), ("gpt2", "host", False)])
def test_the_plans_pinned_host_bytes_are_what_wrap_asks_of_the_pool(device, nvme_dir, family, optimizer, exact):
    # The runtime refuses a TIERFLOW_HOST_MEMORY below its pool's need (optimizer::state_pool_need: the states, or
    # on NVMe two buffers of the largest parameter's state, and one step's gradients and new weights in pinned
    # staging): the plan's figure is that need, not the states alone (which undercounted: "fits" where wrap
    # refused). To the byte where the shape's tensors are the model's; GPT-2 fuses q, k, v (and keeps Conv1D
    # weights) that the shape counts one by one: a few pool pages over, never under.
    config = FAMILIES[family]()
    need, states = _plan_pinned_host_bytes(config, optimizer)
    assert need > states
    assert not _wrap_refuses(config, device, optimizer, need, str(nvme_dir))
    assert _wrap_refuses(config, device, optimizer, need - 1 if exact else states, str(nvme_dir))
