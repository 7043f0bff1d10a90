"""The model zoo: architectures nobody here wrote, with their default configs, under every activation mode.

Each family is built from a tiny config in-process (nothing is downloaded) and is otherwise as its library ships
it: ``use_cache=True``, dropouts as configured (GPT-2, BERT, T5 and torch's nn.Transformer at 0.1), SDPA
attention where the library picks it, Mixtral's router (a mixture of experts: which tokens reach which expert
changes every step under the same input shapes), peft's LoRA on GPT-2 (frozen base weights). Every family trains with and without tierflow on the same
device, data and seed under each TIERFLOW_OFFLOAD_ACTIVATIONS mode and under a mixed plan that gives its blocks
keep, split, swap and recompute (what ``auto`` picks under a tight budget, forced here so that every family gets
every action whatever its measured times), with ``offload_optimizer="none"``: bit-identical to the baseline,
which every one of these modes promises. With the default CPU optimizer: within its rounding of torch's AdamW.

Sizes: 4 blocks (T5 and nn.Transformer: 2 + 2) of width 32, 16 tokens, batch 2, 3 steps; the whole file runs in
about a minute per emulated mode on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from harness import Task, assert_bit_identical, assert_close, torch_device, train

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")

VOCAB, SEQ, BATCH, WIDTH, LAYERS, STEPS = 96, 16, 2, 32, 4, 3
OPT_NONE = dict(offload_optimizer="none", min_offload_bytes=0)


def _ids(i: int, n: int = SEQ) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, n), generator=torch.Generator().manual_seed(7000 + i))


def _causal_lm(cls, config_cls, **extra) -> Task:
    def make():
        return cls(config_cls(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                              max_position_embeddings=64, **extra))

    return Task(make, lambda i: (_ids(i),), lambda m, b: m(input_ids=b[0], labels=b[0]).loss)


def _gpt2() -> Task:
    def make():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4,
                                                                    vocab_size=VOCAB, n_positions=64))

    return Task(make, lambda i: (_ids(i),), lambda m, b: m(input_ids=b[0], labels=b[0]).loss)


def _gpt2_lora() -> Task:
    """peft's LoRA on GPT-2's attention projections: the base weights frozen, the adapters (with their dropout)
    trained; an optimizer over every parameter, as many fine-tuning scripts build it."""
    peft = pytest.importorskip("peft", reason="peft is a test dependency (scripts/setup.sh installs it); "
                                              "not importable here")
    base = _gpt2()

    def make():
        return peft.get_peft_model(base.make_model(), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.1, fan_in_fan_out=True))

    return Task(make, base.make_batch, base.loss)


def _bert() -> Task:
    def make():
        return transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=64))

    def batch(i: int) -> tuple:
        ids = _ids(i)
        mask = torch.ones_like(ids)
        mask[1, SEQ - 4:] = 0                         # a padded sequence
        labels = torch.where(torch.arange(SEQ) % 3 == 0, ids, torch.full_like(ids, -100))
        return ids, mask, labels

    return Task(make, batch, lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss)


def _t5() -> Task:
    def make():
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=WIDTH, d_ff=2 * WIDTH, d_kv=8, num_layers=LAYERS // 2, num_heads=4, vocab_size=VOCAB,
            decoder_start_token_id=0, pad_token_id=0))

    def batch(i: int) -> tuple:
        ids = _ids(i)
        mask = torch.ones_like(ids)
        mask[0, SEQ - 3:] = 0
        return ids, mask, _ids(100 + i, SEQ // 2)

    return Task(make, batch, lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss)


def _vit() -> Task:
    def make():
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=4,
            image_size=32, patch_size=8, num_labels=10))

    def batch(i: int) -> tuple:
        g = torch.Generator().manual_seed(8000 + i)
        return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)

    return Task(make, batch, lambda m, b: m(pixel_values=b[0], labels=b[1]).loss)


class TorchSeq2Seq(nn.Module):
    """torch's nn.Transformer (encoder and decoder stacks, dropout 0.1) with a padding mask and a causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.core = nn.Transformer(d_model=WIDTH, nhead=4, num_encoder_layers=LAYERS // 2,
                                   num_decoder_layers=LAYERS // 2, dim_feedforward=2 * WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        out = self.core(self.embed(src), self.embed(tgt), tgt_mask=causal, src_key_padding_mask=pad,
                        tgt_is_causal=True)
        return self.head(out)


def _torch_transformer() -> Task:
    def batch(i: int) -> tuple:
        pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        pad[1, SEQ - 5:] = True
        return _ids(i), _ids(200 + i), pad

    def loss(m, b):
        return F.cross_entropy(m(b[0], b[1], b[2]).reshape(-1, VOCAB), b[1].roll(-1, 1).reshape(-1))

    return Task(TorchSeq2Seq, batch, loss)


class MlpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class AttributeStack(nn.Module):
    """Blocks held as attributes, no ModuleList or Sequential (as some hand-written models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block0, self.block1, self.block2, self.block3 = (MlpBlock() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in (self.block0, self.block1, self.block2, self.block3):
            x = b(x)
        return self.head(x)


def _attribute_stack() -> Task:
    return Task(AttributeStack, lambda i: (_ids(i),),
                lambda m, b: F.cross_entropy(m(b[0]).reshape(-1, VOCAB), b[0].roll(-1, 1).reshape(-1)))


# name -> (task, the class of its blocks as tierflow finds them)
ZOO = {
    "gpt2": (_gpt2, ("GPT2Block",)),
    "gpt2_lora": (_gpt2_lora, ("GPT2Block",)),
    "llama": (lambda: _causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig), ("LlamaDecoderLayer",)),
    "mistral": (lambda: _causal_lm(transformers.MistralForCausalLM, transformers.MistralConfig),
                ("MistralDecoderLayer",)),
    "qwen2": (lambda: _causal_lm(transformers.Qwen2ForCausalLM, transformers.Qwen2Config), ("Qwen2DecoderLayer",)),
    "mixtral": (lambda: _causal_lm(transformers.MixtralForCausalLM, transformers.MixtralConfig, num_local_experts=4,
                                   num_experts_per_tok=2), ("MixtralDecoderLayer",)),
    # Gemma 2 (attention logits soft-capped, sliding-window layers between global ones), Gemma 3's text model
    # (local and global rotary bases), Phi-3 (fused qkv and gate-up projections), Qwen3-MoE (another router),
    # Cohere (attention and MLP in parallel on one LayerNorm): as transformers 4.57 and 5 ship them.
    "gemma2": (lambda: _causal_lm(transformers.Gemma2ForCausalLM, transformers.Gemma2Config, head_dim=8),
               ("Gemma2DecoderLayer",)),
    "gemma3": (lambda: _causal_lm(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, head_dim=8),
               ("Gemma3DecoderLayer",)),
    "phi3": (lambda: _causal_lm(transformers.Phi3ForCausalLM, transformers.Phi3Config, pad_token_id=0),
             ("Phi3DecoderLayer",)),
    "qwen3_moe": (lambda: _causal_lm(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, head_dim=8,
                                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                  ("Qwen3MoeDecoderLayer",)),
    "cohere": (lambda: _causal_lm(transformers.CohereForCausalLM, transformers.CohereConfig), ("CohereDecoderLayer",)),
    "bert": (_bert, ("BertLayer",)),
    "t5": (_t5, ("T5Block",)),
    "vit": (_vit, ("ViTLayer",)),
    "torch_transformer": (_torch_transformer, ("TransformerEncoderLayer", "TransformerDecoderLayer")),
    "attribute_stack": (_attribute_stack, ("MlpBlock",)),
}
MIXED = ["keep", "split", "swap", "recompute"]  # block i gets MIXED[i % 4]


@pytest.fixture(autouse=True)
def _quiet_wrap_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tierflow.wrap: .* has config.use_cache=True")
        yield


_baselines: dict = {}


def baseline(name: str, device: str):
    """The run without tierflow, once per family and device."""
    if (name, device) not in _baselines:
        _baselines[(name, device)] = train(ZOO[name][0](), STEPS, False, device=device)
    return _baselines[(name, device)]


def _force_mixed_plan(session) -> list:
    """Gives block i the action MIXED[i % 4]; a split whose rows are not exact on this device recomputes."""
    planner = session.planner
    blocks = []
    for i, r in enumerate(planner.runners):
        mode = MIXED[i % len(MIXED)]
        blocks.append({"mode": "swap" if mode == "swap" else mode, "alpha": 0.5, "tier": "host"})
    plan = {"blocks": blocks}
    for i in planner.probe(plan):
        blocks[i]["mode"] = "recompute"
    planner.apply(plan)
    planner.plan = dict(plan, summary="forced mixed plan", lines=[], predicted_device_peak_bytes=0,
                        predicted_step_seconds=0.0)
    return [b["mode"] for b in blocks]


def train_mixed(task: Task, device: str) -> tuple:
    """STEPS steps: the first records every block (recompute), then the mixed plan. Returns the losses, the
    final state, the modes and the session's report."""
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations="recompute", **OPT_NONE)
    losses, modes = [], []
    for step in range(STEPS):
        loss = task.loss(model, task.batch_on(step, device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            modes = _force_mixed_plan(tierflow.current_session())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, modes, tierflow.report()


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.transformers
def test_blocks_are_found(name):
    task, classes = ZOO[name][0](), ZOO[name][1]
    from tierflow.activations.blocks import find_blocks

    blocks = find_blocks(task.make_model())
    assert len(blocks) == LAYERS and {type(b).__name__ for b in blocks} == set(classes), \
        [type(b).__name__ for b in blocks]


@pytest.mark.parametrize("mode", ["none", "host", "auto", "recompute"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_mode_is_bit_identical_to_the_baseline(device, name, mode):
    task = ZOO[name][0]()
    tier = train(task, STEPS, True, device=device, offload_activations=mode, **OPT_NONE)
    assert_bit_identical(baseline(name, device), tier)
    if mode in ("auto", "recompute"):
        assert tier.report["plan"]["blocks"] == LAYERS, tier.report["plan"]


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.transformers
def test_a_mixed_plan_is_bit_identical_to_the_baseline(device, name):
    losses, params, modes, report = train_mixed(ZOO[name][0](), device)
    base = baseline(name, device)
    assert losses == base.losses, (modes, losses, base.losses)
    for k, v in params.items():
        assert torch.equal(v, base.params[k]), (k, modes)
    assert {"keep", "swap", "recompute"} <= set(modes), modes
    r = report["plan"]
    assert r["replays"] > 0, r


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.transformers
def test_the_default_settings_match_torch_adamw(device, name):
    task = ZOO[name][0]()
    base, tier = dataclasses.replace(baseline(name, device)), train(task, STEPS, True, device=device)
    # nn.MultiheadAttention's key bias has an exact gradient of zero (softmax ignores a shift of the keys): it
    # moves by Adam-normalised rounding noise, at most lr a step, in either run. The rest is compared tightly.
    lr = 1e-3
    for run in (base, tier):
        run.params = dict(run.params)
    for k in [k for k in base.params if k.endswith("in_proj_bias")]:
        key = slice(WIDTH, 2 * WIDTH)
        assert (base.params[k][key] - tier.params[k][key]).abs().max() <= 2 * STEPS * lr, k
        for run in (base, tier):
            run.params[k] = torch.cat([run.params[k][:WIDTH], run.params[k][2 * WIDTH:]])
    assert_close(base, tier)
    assert tier.report["optimizer"]["steps"] >= STEPS


@pytest.mark.transformers
def test_a_data_dependent_block_swaps_whole_and_says_so_once(device, capfd):
    # Mixtral routes other tokens to each expert every step: its layers' forwards depart from the tables their
    # first forward recorded. Each layer says so once, swaps whole from then on, and the run stays the baseline's.
    task = ZOO["mixtral"][0]()
    if hasattr(transformers.MixtralForCausalLM, "set_experts_implementation"):
        # transformers 5 runs the experts through grouped_mm by default, on token groups padded to fixed shapes:
        # the same ops every step (test_every_mode covers it). Its "eager" loop over the experts hit is the
        # data-dependent one, as transformers 4's only implementation was.
        make = task.make_model

        def eager() -> torch.nn.Module:
            model = make()
            model.set_experts_implementation("eager")
            return model

        task = dataclasses.replace(task, make_model=eager)
    tier = train(task, STEPS + 1, True, device=device, offload_activations="recompute", **OPT_NONE)
    base = train(task, STEPS + 1, False, device=device)
    assert_bit_identical(base, tier)
    departed = tier.report["plan"]["data_dependent"]
    assert sorted(departed) == list(range(LAYERS)), departed
    err = capfd.readouterr().err
    for i in range(LAYERS):
        said = [line for line in err.splitlines() if f"block {i} (MixtralDecoderLayer)" in line]
        assert len(said) == 1 and "depends on its data" in said[0], said
    # The other families run the same ops every step: none departs.
    assert not train(ZOO["llama"][0](), STEPS, True, device=device, offload_activations="recompute",
                     **OPT_NONE).report["plan"]["data_dependent"]
