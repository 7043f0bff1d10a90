"""Parameters off the device under the ways models use them (issue 38, items 1, 3 and 4; Note [Parameter hooks]).

Each case trains a model with TIERFLOW_OFFLOAD_PARAMS=host and =nvme and the same model, data and seed without
tierflow, bit for bit (a torch AdamW: offload_optimizer="none", min_offload_bytes=0), and asserts the parameters'
device peak (tierflow.report()["params"]["device_peak_bytes"], the schedule's count) twice: within the budget given
as gpu_memory (TIERFLOW_GPU_MEMORY), a promise, and within what the pattern's order needs at once, a number each case
derives from the model's unit sizes (B: the largest block's parameter bytes; R: every parameter outside the blocks;
E: the embedding-sized tensor) and explains where it is computed. What each case guards:

- test_shared_inputs_do_not_hold_blocks (T5): position_bias, an input every block of a stack shares, and the
  encoder's output, which every decoder block's cross-attention reads, do not keep the blocks that took them on the
  device until their total gradient is ready (uses per call, not per tensor). Issue: ~7 of T5's 12 blocks stayed
  through backward; with gpu_memory set, the parameters peaked at twice the budget.
- test_two_forwards_before_one_backward / test_retain_graph_and_a_second_backward (GPT-2): DPO's chosen and rejected
  passes through one model, and a retained graph's second backward, fetch and release each block per call.
  Issue: 100% of the parameters stayed on the device.
- test_inline_tied_head (a small OLMo-like model defined here): a head read inline, ``F.linear(h, self.wte.weight)``
  outside any module, trains on (issue: step 0 matched, step 1 raised "out of bounds for storage of size 0").
- test_large_vocabulary (GPT-2 tied, Llama untied, vocab 4096 x width 64: the embedding is ~5 blocks): the non-block
  parameters are fetched per use (embeddings at the start, norm and head at the end), under a budget that holding
  the embeddings through the step would exceed.
- test_reading_parameters_after_training (GPT-2, in a child process): ``[p.detach().clone() for p in
  model.parameters()]`` after training either gives the trained values or raises a RuntimeError naming the parameter
  and pointing at tierflow.gathered, which then gives them; never a crash (issue: SIGSEGV every time).
- test_a_budget_the_pattern_cannot_meet_is_refused: under a budget below one block it is refused by an error naming
  TIERFLOW_GPU_MEMORY; under tight ones (the largest unit and half a block; two blocks and the rest) each pattern
  (T5, two forwards, the inline head at vocab 256 and at 4096) trains within it or is refused so, at wrap or in a
  step; never exceeded in silence.

Sizes: 4 blocks (T5: 4 + 4, the fewest where a shared input holds more blocks than the order needs) of width 32-64,
3 steps; offload_activations="none", so the parameters are all the budget counts on the emulated device.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from children import run_child
from harness import Run, Task, assert_bit_identical, subprocess_environment, train
from tierflow.activations.blocks import find_blocks

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")

from test_model_zoo import SEQ, VOCAB, WIDTH, ZOO  # noqa: E402  (the zoo's families, built the zoo's way)

STEPS = 3
OPT_NONE = dict(offload_optimizer="none")  # (min_offload_bytes=0 is moot: offload_activations="none")
TIERS = ["host", "nvme"]


@pytest.fixture(autouse=True)
def _quiet_wrap_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="tierflow.wrap: .* has config.use_cache=True")
        yield


def _emulated_only(device: str) -> None:
    if device != "emulated":
        pytest.skip("a torch optimizer steps the host copies only on the emulated device; on CUDA it is refused "
                    "(test_params.py::test_torch_optimizer_refusal_text)")


def _settings(tier: str, nvme_dir: str, budget: int) -> dict:
    s = dict(offload_params=tier, offload_activations="none", gpu_memory=str(budget), **OPT_NONE)
    if tier == "nvme":
        s["nvme_paths"] = [nvme_dir]
    return s


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


class Sizes:
    """The parameter bytes of a model's units as tierflow finds them (Note [Finding blocks])."""

    def __init__(self, task: Task) -> None:
        torch.manual_seed(0)
        model = task.make_model()
        blocks = find_blocks(model)
        inside = {id(p) for b in blocks for p in b.parameters()}
        self.n_blocks = len(blocks)
        self.blocks = [sum(_nbytes(p) for p in b.parameters()) for b in blocks]
        self.block = max(self.blocks)                                          # B
        self.rest_tensors = [_nbytes(p) for p in model.parameters() if id(p) not in inside]
        self.rest = sum(self.rest_tensors)                                     # R
        self.total = sum(self.blocks) + self.rest

    def __repr__(self) -> str:
        return (f"{self.n_blocks} blocks, the largest B={self.block} B, non-block R={self.rest} B "
                f"(tensors {sorted(self.rest_tensors, reverse=True)[:4]}...), total {self.total} B")


def _peak(run: Run) -> int:
    return run.report["params"]["device_peak_bytes"]


def _check(run: Run, base: Run, budget: int, bound: int, sizes: Sizes, bound_says: str) -> None:
    """Bit for bit the baseline; the parameters' device peak within the budget and within the order's count."""
    peak = _peak(run)
    said = (f"parameters' device peak {peak} B ({peak / sizes.block:.2f} blocks, {peak / sizes.total:.0%} of the "
            f"parameters) against the budget {budget} B ({peak / budget:.2f}x) and the order's count {bound} B "
            f"({bound_says}); {sizes}; report {run.report['params']}")
    assert_bit_identical(run, base)
    assert peak <= budget, "over TIERFLOW_GPU_MEMORY: " + said
    assert peak <= bound, "more than the order needs at once: " + said


# ---- 1. shared inputs: T5 --------------------------------------------------------------------------------------


def _t5(layers: int = 4) -> Task:
    """ZOO's t5 (its batch and loss, its config) with `layers` blocks per stack. At the zoo's 2 + 2, a shared input
    can hold no more blocks than the order needs anyway; at 4 + 4 it holds most of a stack."""
    zoo = ZOO["t5"][0]()

    def make():
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=WIDTH, d_ff=2 * WIDTH, d_kv=8, num_layers=layers, num_heads=4, vocab_size=VOCAB,
            decoder_start_token_id=0, pad_token_id=0))

    return Task(make, zoo.make_batch, zoo.loss)


# What the order needs at once, for a stack of blocks used once per call (items 1 and 2): one block in use, the
# block whose use just ended (its release and the next block's begin meet at one gradient: give it its room), one
# block fetched ahead (the schedule's window, one unit), and the non-block units (small in these models: T5's shared
# embedding and final norms, GPT-2's embeddings and final norm at vocab 96), all of them at once at most:
# 3 B + R. The budget gives half a block more, so that the two assertions say different things: a schedule that
# keeps one block too many is within the promise but not within the order's count.
def _blocks_bound(sizes: Sizes) -> tuple:
    bound = 3 * sizes.block + sizes.rest
    return bound, bound + sizes.block // 2


@pytest.mark.parametrize("tier", TIERS)
def test_shared_inputs_do_not_hold_blocks(device, tier, nvme_dir):
    _emulated_only(device)
    task = _t5()
    sizes = Sizes(task)
    bound, budget = _blocks_bound(sizes)
    base = train(task, STEPS, False, device=device)
    run = train(task, STEPS, True, device=device, **_settings(tier, nvme_dir, budget))
    _check(run, base, budget, bound, sizes, "3 blocks + R: in use, just ended, one ahead, and the non-block units")


# ---- 2. two forwards before one backward; retain_graph ------------------------------------------------------------


def _sequence_logp(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def _dpo() -> Task:
    """DPO's loss shape: the chosen and the rejected sequence through the same model, one loss from both."""
    zoo = ZOO["gpt2"][0]()

    def batch(i: int) -> tuple:
        chosen, = zoo.make_batch(i)
        rejected, = zoo.make_batch(500 + i)
        return chosen, rejected

    def loss(m, b):
        return -F.logsigmoid(0.1 * (_sequence_logp(m, b[0]) - _sequence_logp(m, b[1]))).mean()

    return Task(zoo.make_model, batch, loss)


def _retained() -> Task:
    """A backward that keeps the graph, then a second backward through it (harness.train's): gradients twice."""
    zoo = ZOO["gpt2"][0]()

    def loss(m, b):
        out = zoo.loss(m, b)
        out.backward(retain_graph=True)
        return out

    return Task(zoo.make_model, zoo.make_batch, loss)


@pytest.mark.parametrize("tier", TIERS)
def test_two_forwards_before_one_backward(device, tier, nvme_dir):
    _emulated_only(device)
    task = _dpo()
    sizes = Sizes(task)
    bound, budget = _blocks_bound(sizes)
    base = train(task, STEPS, False, device=device)
    run = train(task, STEPS, True, device=device, **_settings(tier, nvme_dir, budget))
    _check(run, base, budget, bound, sizes, "3 blocks + R, as for one forward: each call's use is its own")


@pytest.mark.parametrize("tier", TIERS)
def test_retain_graph_and_a_second_backward(device, tier, nvme_dir):
    _emulated_only(device)
    task = _retained()
    sizes = Sizes(task)
    bound, budget = _blocks_bound(sizes)
    base = train(task, STEPS, False, device=device)
    run = train(task, STEPS, True, device=device, **_settings(tier, nvme_dir, budget))
    _check(run, base, budget, bound, sizes, "3 blocks + R in each backward: the second fetches the blocks again")


# ---- 3. a head tied to the embedding, read inline ---------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        # OLMo's layer norms have no parameters (elementwise_affine=False); nor has the final one below, so no
        # module of the model's own runs after the blocks: the head's read of wte.weight is the only use there.
        self.ln1, self.ln2 = (nn.LayerNorm(width, elementwise_affine=False) for _ in range(2))
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class InlineHeadLM(nn.Module):
    """OLMo's way of writing a tied head: no lm_head module; the forward ends with F.linear(h, self.wte.weight)."""

    def __init__(self, vocab: int = 256, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, elementwise_affine=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_f(h), self.wte.weight)


def _inline_head(vocab: int = 256) -> Task:
    def batch(i: int) -> tuple:
        return (torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7300 + i)),)

    def loss(m, b):
        logits = m(b[0])
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b[0][:, 1:].reshape(-1))

    return Task(lambda: InlineHeadLM(vocab), batch, loss)


@pytest.mark.parametrize("tier", TIERS)
def test_inline_tied_head(device, tier, nvme_dir):
    _emulated_only(device)
    task = _inline_head()
    sizes = Sizes(task)
    # The inline read of wte.weight is served and held from the read (the forward's end) to the end of the step,
    # beside the blocks the order needs at once (3, as above): R + 3 B (R is wte alone, E = 64 KiB; the norms
    # have no parameters). The budget: half a block more.
    bound, budget = _blocks_bound(sizes)
    base = train(task, STEPS, False, device=device)
    run = train(task, STEPS, True, device=device, **_settings(tier, nvme_dir, budget))
    _check(run, base, budget, bound, sizes, "the inline-read weight (R) held to the step's end + 3 blocks")


# ---- 4. a large vocabulary ------------------------------------------------------------------------------------------

BIG_VOCAB = 4096


def _big_vocab(kind: str) -> Task:
    """Vocab 4096 x width 64: the embedding (1 MiB) outweighs a block (~0.2 MiB) five times. gpt2: the head tied to
    the embedding (one tensor used at the start and the end); llama: untied (two)."""
    def make():
        if kind == "gpt2":
            return transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=4, n_embd=64, n_head=4, vocab_size=BIG_VOCAB, n_positions=SEQ))
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=BIG_VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False))

    def batch(i: int) -> tuple:
        return (torch.randint(1, BIG_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7400 + i)),)

    return Task(make, batch, lambda m, b: m(input_ids=b[0], labels=b[0]).loss)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_large_vocabulary(device, kind, tier, nvme_dir):
    _emulated_only(device)
    task = _big_vocab(kind)
    sizes = Sizes(task)
    embedding = BIG_VOCAB * 64 * 4                            # E: one embedding-sized tensor
    small = sizes.rest - embedding * (1 if kind == "gpt2" else 2)  # S: position embeddings, final norm
    b = sizes.block
    assert embedding > 4 * b, sizes
    # Per use: the embedding (or the head) in use with the next unit fetched ahead, a block: E + S + B; blocks alone
    # need 3 B + S < E. The budget gives half a block more: E + S + 1.5 B. Holding the embeddings through the step
    # would put E (gpt2; 2 E for llama) beside a block in use and the next one fetched: E + S + 2 B, over it.
    # The order's count here is the budget itself: the prefetch window is the largest unit (E, five blocks), so a
    # schedule may fill what the budget leaves beside the embedding with parameters of the blocks ahead (measured:
    # E + S + 1.34 B); what shows the embeddings are fetched per use is a peak within a budget that holding them
    # would exceed.
    budget = embedding + small + b + b // 2
    held = sizes.rest + 2 * b
    assert held > budget, (held, budget, sizes)
    base = train(task, STEPS, False, device=device)
    run = train(task, STEPS, True, device=device, **_settings(tier, nvme_dir, budget))
    _check(run, base, budget, budget, sizes, f"E={embedding} + S={small} + 1.5 blocks; held through the step: {held}")


# ---- 5. reading the parameters after training ----------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import tierflow
    from harness import train
    from test_model_zoo import ZOO

    tier, nvme_dir = sys.argv[1], sys.argv[2]
    task = ZOO["gpt2"][0]()
    base = train(task, 4, False, device="emulated")
    names = [n for n, _ in task.make_model().named_parameters()]
    torch.manual_seed(0)
    model = task.model_on("emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    extra = dict(nvme_paths=[nvme_dir]) if tier == "nvme" else {}
    model, opt = tierflow.wrap(model, opt, device="emulated", offload_params=tier, offload_activations="none",
                               offload_optimizer="none", **extra)

    def step(i):
        loss = task.loss(model, task.batch_on(i, "emulated"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step(i) for i in range(3)]
    out = dict(names=names, trained_match=losses == base.losses[:3])
    expected = train(task, 3, False, device="emulated").params  # the baseline's after 3 steps
    try:
        values = [p.detach().clone() for p in model.parameters()]  # the read users do to save, compare, evaluate
        out["outcome"] = "served"
    except RuntimeError as e:
        out["outcome"], out["message"] = "refused", str(e)
        with tierflow.gathered(model):
            values = [p.detach().clone() for p in model.parameters()]
    out["values_match"] = all(torch.equal(v, expected[n]) for n, v in zip(names, values))
    out["then_trains"] = step(3) == base.losses[3]  # the read left a model that trains on
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.parametrize("tier", TIERS)
def test_reading_parameters_after_training(device, tier, nvme_dir):
    """In a child: a crash (the issue's SIGSEGV) fails this test instead of ending pytest."""
    _emulated_only(device)
    here = os.path.dirname(os.path.abspath(__file__))
    env = subprocess_environment()
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.join(here, "..", "..", "bindings", "python"),
                                         os.path.join(here, "..", "..", "examples"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = run_child([sys.executable, "-c", _CHILD, tier, nvme_dir], env=env, cwd=here, capture_output=True,
                     text=True)
    output = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode < 0:
        pytest.fail(f"the child died of signal {-proc.returncode} reading the parameters after training:\n{output}")
    assert proc.returncode == 0, output
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["trained_match"], output
    if result["outcome"] == "refused":
        message = result["message"]
        named = re.search(r"parameter '([^']+)'", message)
        assert named and named.group(1) in result["names"], f"the error names no parameter of the model: {message}"
        assert "tierflow.gathered" in message, f"the error does not point at tierflow.gathered: {message}"
    assert result["values_match"], f"the values read ({result['outcome']}) are not the trained ones: {result}"
    assert result["then_trains"], f"training after the read differs from the baseline's: {result}"


# ---- 6. a budget the pattern cannot meet ---------------------------------------------------------------------------

# inline_head_4096: the inline-read embedding (1 MiB) outweighs a block five times, so holding it from the read to
# the end of the step beside a block in backward needs E + B at once, more than largest_and_half_a_block gives.
PATTERNS = {"t5": _t5, "two_forwards": _dpo, "inline_head": _inline_head,
            "inline_head_4096": lambda: _inline_head(BIG_VOCAB)}
ROOMS = ["below_a_block", "largest_and_half_a_block", "two_blocks"]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("room", ROOMS)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_a_budget_the_pattern_cannot_meet_is_refused(device, pattern, room, tier, nvme_dir):
    """below_a_block: B - 1, under the one block every order has in use: refused. largest_and_half_a_block: the
    largest unit (a block, or a non-block tensor) and half a block, too little for a unit in use and the next one
    beside it; two_blocks: 2 B + R, the order's count without the block that just ended. Under those two, trained
    within the budget (bit for bit, peak within) or refused. A refusal names TIERFLOW_GPU_MEMORY, at wrap or during
    a step, and nothing fetched before it went over the budget: never exceeded in silence."""
    _emulated_only(device)
    task = PATTERNS[pattern]()
    sizes = Sizes(task)
    budget = {"below_a_block": sizes.block - 1,
              "largest_and_half_a_block": max([sizes.block] + sizes.rest_tensors) + sizes.block // 2,
              "two_blocks": 2 * sizes.block + sizes.rest}[room]
    before = tierflow.current_session()
    try:
        run = train(task, STEPS, True, device=device, **_settings(tier, nvme_dir, budget))
    except Exception as e:  # noqa: BLE001  (which error, and what it says, is the assertion)
        assert "TIERFLOW_GPU_MEMORY" in str(e), f"refused by {type(e).__name__} not naming TIERFLOW_GPU_MEMORY: {e}"
        session = tierflow.current_session()
        if session is not None and session is not before:  # refused after wrap: nothing went over first
            peak = session.report()["params"]["device_peak_bytes"]
            assert peak <= budget, f"refused, but only after going over: peak {peak} B > budget {budget} B"
        return
    assert room != "below_a_block", f"trained under a budget below one block ({budget} B; {sizes}): {_peak(run)} B"
    assert _peak(run) <= budget, f"over TIERFLOW_GPU_MEMORY in silence: peak {_peak(run)} B > {budget} B; {sizes}"
    assert_bit_identical(run, train(task, STEPS, False, device=device))


# ---- what an adversarial review found (issue 38's review): each trains bit for bit within the order's count -----


class _ShapedBlock(_Block):
    """_Block with what a call may hold beyond its input's path: ``latent``, a weight branch that meets the input
    late (Perceiver's latents, Q-Former's queries); ``merged``, a weight computed before it is applied (a LoRA
    merged into its base: W + B @ A); ``aux``, an output the caller drops (its nodes never run)."""

    def __init__(self, width: int, shape: str) -> None:
        super().__init__(width)
        self.shape = shape
        self.latent = nn.Parameter(torch.randn(1, 1, width) * 0.1) if shape == "latent" else None
        self.lora_a = nn.Parameter(torch.randn(4, width) * 0.1) if shape == "merged" else None
        self.lora_b = nn.Parameter(torch.randn(width, 4) * 0.1) if shape == "merged" else None

    def forward(self, x: torch.Tensor) -> Any:
        if self.shape == "merged":
            w = self.proj.weight + self.lora_b @ self.lora_a  # made before x meets it: a branch of weights only
            x = x + F.linear(self.ln1(x), w, self.proj.bias)
        lat = self.proj(self.latent) if self.shape == "latent" else None  # before x's path: runs after it
        if self.shape == "aux_attr":  # an auxiliary loss kept on the module, added to the loss later
            self.aux = self.up.weight.pow(2).mean()
        if self.shape == "aux_dict":  # ... or in a dict attribute
            self.auxes = {"gate": self.up.weight.pow(2).mean()}
        h = super().forward(x)
        if lat is not None:
            return h + lat
        if self.shape == "aux":
            return h, self.ln2(x) * 2.0  # the caller drops the second
        if self.shape == "dataclass":
            return _Out(h)
        return h


class _Out:
    """A block's output that is no pytree (a plain object holding the tensor)."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _ShapedLM(InlineHeadLM):
    def __init__(self, shape: str, checkpoint: Any = False) -> None:
        super().__init__(vocab=96)
        self.blocks = nn.ModuleList(_ShapedBlock(64, shape) for _ in range(4))
        self.head = nn.Linear(64, 96)
        self.checkpoint = checkpoint

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        if self.checkpoint == "all":  # one non-reentrant checkpoint around every block
            h = torch.utils.checkpoint.checkpoint(lambda t: self._blocks(t), h, use_reentrant=False)
        else:
            h = self._blocks(h)
        out = self.head(self.ln_f(h))
        aux = [b.aux for b in self.blocks if getattr(b, "aux", None) is not None] + \
            [b.auxes["gate"] for b in self.blocks if getattr(b, "auxes", None)]
        return out + 0.1 * sum(aux) if aux else out

    def _blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpoint is True:  # HF's gradient_checkpointing_enable default (transformers 4.57): reentrant
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
            else:
                h = block(h)
            h = h[0] if isinstance(h, tuple) else h.h if isinstance(h, _Out) else h
        return h


@pytest.mark.parametrize("shape", ["latent", "merged", "aux", "reentrant", "aux_attr", "aux_dict", "dataclass",
                                   "checkpoint_all"])
def test_calls_whose_weights_do_not_only_meet_their_input(device, shape, nvme_dir):
    """A use ends once every last node of its call the backward runs has run (Note [Parameter hooks]): a latent
    branch and a merged weight read their weights after the input's path (before: the released weight's error in
    backward); an output nobody uses does not hold its block to the end of backward (before: over the budget); a
    reentrant checkpoint's recompute ends its use (before: every block held through backward). From the second
    review: an auxiliary loss of weights kept on the module and an output that is no pytree are walked too
    (before: the released weight's error in backward); one non-reentrant checkpoint around every block ends each
    recompute's use with its forward, the engine never running the recompute's graph (before: every block held)."""
    _emulated_only(device)
    task = _inline_head(96)
    checkpoint = {"reentrant": True, "checkpoint_all": "all"}.get(shape, False)
    task = Task(lambda: _ShapedLM("plain" if checkpoint else shape, checkpoint), task.make_batch, task.loss)
    sizes = Sizes(task)
    bound, budget = _blocks_bound(sizes)
    base = train(task, STEPS, False, device=device)
    run = train(task, STEPS, True, device=device, **_settings("host", nvme_dir, budget))
    _check(run, base, budget, bound, sizes, "3 blocks + R")


@pytest.mark.transformers
def test_auto_with_an_inline_head_applies_its_plan(device):
    """offload_params='auto' makes the plan's units resident at the end of the forward it was made in, while the
    inline-read embedding is held (before: an internal assertion in ParamSchedule::make_resident)."""
    _emulated_only(device)
    task = _inline_head()
    base = train(task, 4, False, device=device)
    run = train(task, 4, True, device=device, offload_params="auto", offload_activations="auto", min_offload_bytes=0,
                **OPT_NONE)
    assert_bit_identical(run, base)


def test_a_retained_graphs_second_backward_through_an_inline_read_is_refused_by_name(device):
    """A weight the forward read outside its modules is held through that forward's backward only: a second
    backward through the retained graph is refused with an error that says so (Note [Parameter hooks]), and the
    model trains on."""
    _emulated_only(device)
    torch.manual_seed(0)
    task = _inline_head()
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierflow.wrap(model, opt, device=device, offload_params="host", offload_activations="none",
                               **OPT_NONE)
    loss = task.loss(model, task.batch_on(0, device))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"parameter 'wte\.weight' .* held through the next backward only.*"
                                           r"retain_graph=True"):
        loss.backward()
    opt.zero_grad(set_to_none=True)
    task.loss(model, task.batch_on(1, device)).backward()
    opt.step()
    tierflow.unwrap(model)


def test_two_forwards_then_two_backwards_through_a_weight_read_inline_are_refused_by_name(device):
    """A weight the forward read outside its modules is held through the next backward only (a hold over a step
    would keep a copy the step makes stale): a second forward's backward after the first is refused with an error
    that says so, and the model trains on."""
    _emulated_only(device)
    torch.manual_seed(0)
    task = _inline_head()
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierflow.wrap(model, opt, device=device, offload_params="host", offload_activations="none",
                               **OPT_NONE)
    first = task.loss(model, task.batch_on(0, device))
    second = task.loss(model, task.batch_on(1, device))
    second.backward()
    with pytest.raises(RuntimeError, match=r"parameter 'wte\.weight' .*held through the next backward only.*"
                                           r"a second forward"):
        first.backward()
    opt.zero_grad(set_to_none=True)
    task.loss(model, task.batch_on(2, device)).backward()
    opt.step()
    tierflow.unwrap(model)


def test_a_forward_whose_backward_never_comes_holds_nothing_over_a_step(device):
    """An evaluation forward with gradients enabled whose result is thrown away, and an output no loss reads, leave
    no weight read inline held over a step (a held copy would be stale after step(): silently wrong), and no call
    is kept alive by the hooks (the graph owns them). Both trained bit for bit; nothing on the device between
    steps."""
    _emulated_only(device)
    inline = _inline_head()

    def loss(m, b):
        m(b[0].flip(1))  # an evaluation forward, gradients on, its result dropped
        return inline.loss(m, b)

    task = Task(inline.make_model, inline.make_batch, loss)
    import gc

    from tierflow.params import _Call

    def calls() -> set:
        gc.collect()
        return {id(o) for o in gc.get_objects() if type(o) is _Call}

    before = calls()  # (other tests' graphs may live on)
    base = train(task, 4, False, device=device)
    run = train(task, 4, True, device=device, offload_params="host", offload_activations="none", **OPT_NONE)
    assert_bit_identical(run, base)
    assert run.report["params"]["device_bytes"] == 0, run.report["params"]
    del run
    assert not calls() - before, "calls outlive their graphs"
