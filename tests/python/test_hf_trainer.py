"""transformers' Trainer drives a wrapped model and tierflow's CPU optimizer.

The user's AdamW and a learning-rate schedule made before wrap go to Trainer as ``optimizers=(optimizer,
scheduler)``; Trainer accumulates gradients over 2 micro-batches, clips them to ``max_grad_norm`` (through
accelerate), steps, logs, saves checkpoints (the CPUAdamW's state_dict) and resumes from one. Against the same
Trainer run without tierflow: the parameters within the CPU optimizer's rounding of torch's AdamW; a resumed run
bit-identical to the uninterrupted one.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import tierflow
from harness import torch_device

# Trainer differs between transformers versions: these run again under transformers 5 (Note [Test tiers]).
pytestmark = pytest.mark.transformers

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")
pytest.importorskip("accelerate", reason="accelerate (which Trainer needs) is a test dependency (scripts/setup.sh "
                                         "installs it); not importable here")

VOCAB, SEQ = 96, 16


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(1, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(9000 + i))
        return {"input_ids": ids, "labels": ids}


# transformers 4 saves checkpoints with torch.save when asked; transformers 5 has no such argument (always
# safetensors): a GPU image ships 5.x, CI pins 4.57.6, and the test runs on both.
_NO_SAFETENSORS = ({"save_safetensors": False}
                   if "save_safetensors" in inspect.signature(transformers.TrainingArguments).parameters else {})


def trainer_run(out: str, device: str, settings, resume=None, trainer_clip: float = 1.0) -> tuple:
    """4 optimizer steps of Trainer on a tiny GPT-2 (default config: dropout 0.1, use_cache=True)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                                                 n_positions=64)).to(torch_device(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # made before wrap
    if settings is not None:
        model, opt = tierflow.wrap(model, opt, device=device, **settings)
    args = transformers.TrainingArguments(
        out, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=trainer_clip,
        logging_steps=1, save_steps=2, report_to=[], use_cpu=device != "cuda", seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **_NO_SAFETENSORS)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tierflow.wrap: .* has config.use_cache=True")
        trainer.train(resume_from_checkpoint=resume)
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    report = tierflow.report() if settings is not None else None
    return params, lrs, report


def test_trainer_matches_torch_adamw_and_resumes_bit_for_bit(tmp_path, device):
    base, base_lrs, _ = trainer_run(str(tmp_path / "base"), device, None)
    tier, lrs, report = trainer_run(str(tmp_path / "tier"), device, {})
    assert lrs == base_lrs and len(lrs) == 4  # the schedule made before wrap scheduled tierflow's optimizer
    for k, v in base.items():
        if v.is_floating_point():
            torch.testing.assert_close(tier[k], v, rtol=1e-6, atol=5e-5, msg=f"parameter {k}")
    assert report["optimizer"]["steps"] >= 4
    # Resumed from the step-2 checkpoint (the CPUAdamW's state_dict, the scheduler, the RNG): the run that never
    # stopped, bit for bit.
    resumed, _, _ = trainer_run(str(tmp_path / "tier"), device, {}, resume=str(tmp_path / "tier" / "checkpoint-2"))
    for k, v in tier.items():
        assert torch.equal(resumed[k], v), k


def test_trainer_with_activation_offload_and_your_optimizer_is_bit_identical(tmp_path, device):
    base, _, _ = trainer_run(str(tmp_path / "base"), device, None)
    tier, _, report = trainer_run(str(tmp_path / "tier"), device,
                                  dict(offload_optimizer="none", offload_activations="recompute"))
    for k, v in base.items():
        assert torch.equal(tier[k], v), k
    assert report["plan"]["replays"] == 4 * 2 * 2  # 2 blocks, 2 micro-batches, 4 steps


def test_clip_and_accumulation_given_to_tierflow_waste_no_step(tmp_path, device):
    # Trainer accumulates and clips behind the optimizer's back: every step tierflow takes during backward is
    # taken back (the next micro-batch changes the gradient) or redone (the clip rewrites it), correct but wasted.
    # Given to tierflow instead (grad_accumulation_steps and max_grad_norm in wrap, max_grad_norm=0 in
    # TrainingArguments), the clip is exactly clip_grad_norm_'s and nothing is redone or taken back.
    base, _, _ = trainer_run(str(tmp_path / "base"), device, None)
    theirs = trainer_run(str(tmp_path / "theirs"), device, {})[2]["optimizer"]["overlap"]
    tier, _, report = trainer_run(str(tmp_path / "tier"), device, dict(max_grad_norm=1.0, grad_accumulation_steps=2),
                                  trainer_clip=0.0)
    for k, v in base.items():
        if v.is_floating_point():
            torch.testing.assert_close(tier[k], v, rtol=1e-6, atol=5e-5, msg=f"parameter {k}")
    ours = report["optimizer"]["overlap"]
    assert theirs["committed"] == 0 and theirs["taken_back"] + theirs["redone"] > 0, theirs  # all wasted
    assert ours["redone"] == 0 and ours["taken_back"] == 0, ours


@pytest.mark.parametrize("clip", [1e6, 0.05], ids=["clip-not-binding", "clip-binding"])
def test_trainers_clip_is_picked_up_exactly(tmp_path, device, clip):
    # Note [Clip picked up]: Trainer clips through accelerate's clip_grad_norm_ between backward and step. tierflow
    # sees that clip: the parameters are those of the same clip given to tierflow itself, bit for bit, and no early
    # step is fetched again; committed when the clip does not bind, stepped from the landed gradients when it does.
    # Before the pickup every early step was redone from p.grad (committed 0).
    settings = dict(grad_accumulation_steps=2)  # Trainer's accumulation, told to tierflow: only the clip differs
    theirs, _, report = trainer_run(str(tmp_path / "theirs"), device, settings, trainer_clip=clip)
    ours, _, _ = trainer_run(str(tmp_path / "ours"), device, dict(settings, max_grad_norm=clip), trainer_clip=0.0)
    for k, v in ours.items():
        assert torch.equal(theirs[k], v), k
    overlap, streaming = report["optimizer"]["overlap"], report["optimizer"]["streaming"]
    assert streaming["clips_picked_up"] > 0, streaming
    if clip > 1:
        assert overlap["early_steps"] > 0 and overlap["committed"] == overlap["early_steps"], overlap
        assert overlap["redone"] == 0, overlap
    else:  # the running norm stops speculation once the learned clip must bind, as TIERFLOW_MAX_GRAD_NORM's does
        assert streaming["speculation_stops"] >= 3, streaming


class Sentences(torch.utils.data.Dataset):
    """Examples of 6 to 40 tokens, as text of varying length tokenizes to."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(7000 + i)
        n = int(torch.randint(6, 41, (1,), generator=g))
        return {"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}


def pad_to_longest(examples: list) -> dict:
    """What transformers' DataCollatorWithPadding does for a causal LM: each batch padded to its longest example,
    the padding masked out of attention and of the loss."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        ids[row, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[row, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_trainer_with_dynamic_padding_under_auto_is_bit_identical(tmp_path, device):
    """Batches padded to their longest example, a length per batch (Note [Batch growth]): auto's plan grows with
    the longest batch so far, and the run is Trainer's without tierflow bit for bit (your optimizer kept). The
    config's use_cache is off in both, as tierflow's training forwards run: with the cache on, GPT-2's dropout and
    masked attention round otherwise in the last bit (7e-9 in a gradient, plain transformers)."""
    def go(out: str, settings) -> tuple:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         use_cache=False)
        model = transformers.GPT2LMHeadModel(config).to(torch_device(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if settings is not None:
            model, opt = tierflow.wrap(model, opt, device=device, **settings)
        args = transformers.TrainingArguments(
            out, max_steps=8, per_device_train_batch_size=2, report_to=[], use_cpu=device != "cuda", seed=0,
            data_seed=0, dataloader_num_workers=0, disable_tqdm=True, save_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Sentences(), optimizers=(opt, None),
                                       data_collator=pad_to_longest)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="tierflow.wrap: .* has config.use_cache=True")
            trainer.train()
        report = tierflow.report() if settings is not None else None
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, report

    base, _ = go(str(tmp_path / "base"), None)
    tier, report = go(str(tmp_path / "tier"), dict(offload_optimizer="none", offload_activations="auto"))
    for k, v in base.items():
        assert torch.equal(tier[k], v), k
    plan = report["plan"]
    assert plan["batch_elements"] > plan["profiled_batch_elements"], plan  # a longer batch came after the profile
    assert plan["batch_growth"]["replans"] >= 1 and plan["batch_growth"]["refused"] is None
