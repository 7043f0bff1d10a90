"""The fuzzer of users' training loops (tests/python/loop_fuzz.py, issue 37 part 4) over CI's fixed seeds.

Each seed's loop runs without and with tierflow on the emulated device and must match (bit for bit with
``offload_optimizer="none"``, within the CPU AdamW's rounding otherwise) or be refused by an error that names
the idiom. A finding that a known cause explains (loop_fuzz.KNOWN_CAUSES, each with its strict xfail in
test_loop_fuzz_findings.py) is printed and tolerated until its owner removes it; any other fails the chunk,
naming each loop in one line (``python tests/python/loop_fuzz.py --seed N`` runs it again).

CI_SEEDS loops on the polite device; the adversarial pass (Note [Test tiers]) runs every fourth of them, where
copy order can matter. A longer run: ``make fuzz-loops SEEDS=10000`` (scripts/fuzz_loops.py).
"""

from __future__ import annotations

import os

import pytest

import loop_fuzz

CI_SEEDS = 240
CHUNK = 20
ADVERSARIAL_EVERY = 4


def seeds_of(chunk: int) -> list:
    seeds = range(chunk * CHUNK, (chunk + 1) * CHUNK)
    if os.environ.get("TIERFLOW_EMULATED_DEVICE") == "adversarial":
        return [s for s in seeds if s % ADVERSARIAL_EVERY == 0]
    return list(seeds)


@pytest.mark.ordering  # the loops move data through the copy engine and NVMe
@pytest.mark.parametrize("chunk", range(CI_SEEDS // CHUNK), ids=lambda c: f"seeds{c * CHUNK}-{(c + 1) * CHUNK - 1}")
def test_generated_loops_match_or_are_refused_by_name(chunk, tmp_path):
    new, known, outcomes = [], [], {"match": 0, "refused": 0, "finding": 0}
    for seed in seeds_of(chunk):
        loop = loop_fuzz.draw(seed)
        verdict = loop_fuzz.check(loop)
        outcomes[verdict.kind] += 1
        if verdict.ok:
            continue
        attribution = loop_fuzz.attribute(loop, verdict)
        line = f"{loop.line()}: {verdict.cause}: {verdict.detail}"
        if attribution.causes:
            known.append(f"{line} [known: {', '.join(attribution.causes)}]")
        else:
            new.append(f"{line} [without the known causes' triggers: {attribution.residual.cause}: "
                       f"{attribution.residual.detail}]")
    print(f"{outcomes}; known causes:", *known, sep="\n  ")
    assert not new, f"{len(new)} new finding(s) (add a named test to test_loop_fuzz_findings.py):\n" + "\n".join(new)
    assert outcomes["match"] + outcomes["refused"] + outcomes["finding"] == len(seeds_of(chunk))


def test_draw_is_a_function_of_the_seed():
    """A finding's seed is its reproducer: the same seed draws the same loop, and seeds cover the settings."""
    assert loop_fuzz.draw(123) == loop_fuzz.draw(123)
    loops = [loop_fuzz.draw(s) for s in range(CI_SEEDS)]
    for field, values in (("model", loop_fuzz.MODELS), ("acts", loop_fuzz.ACTIVATIONS),
                          ("opt_offload", loop_fuzz.OPTIMIZER_OFFLOAD)):
        assert {getattr(loop, field) for loop in loops} == set(values), field
    for field in ("grad_edit", "clip", "scaler", "ddp", "no_sync", "zero_grad", "frozen", "hook", "two_forwards",
                  "retain_graph", "autocast", "save_load", "scheduler", "offload_params", "offload_gradients"):
        assert len({getattr(loop, field) for loop in loops}) > 1, f"CI's seeds never vary {field}"


@pytest.mark.ordering
def test_the_comparison_sees_a_one_ulp_change_and_a_named_refusal_passes(monkeypatch):
    """The fuzzer can fail: a tierflow run whose parameter moved by one ulp is a finding in the exact mode, and a
    refusal that names nothing of the loop is one too; a refusal naming the idiom is not."""
    import torch

    loop = loop_fuzz.Loop(seed=3, acts="host", opt_offload="none")
    assert loop_fuzz.check(loop).kind == "match"
    real_run = loop_fuzz.run

    def nudged(loop_, use_tierflow, nvme_dir=None):
        result = real_run(loop_, use_tierflow, nvme_dir)
        if use_tierflow:
            w = result.state["out.weight"]
            w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))
        return result

    monkeypatch.setattr(loop_fuzz, "run", nudged)
    verdict = loop_fuzz.check(loop)
    assert verdict.kind == "finding" and verdict.cause == "differs:param" and "out.weight" in verdict.detail

    import tierflow

    def refusing(message):
        def fake(loop_, use_tierflow, nvme_dir=None):
            if use_tierflow:
                raise loop_fuzz.Refused(tierflow.TierflowError(message), "wrap")
            return real_run(loop_, use_tierflow, nvme_dir)
        return fake

    scaled = loop_fuzz.Loop(seed=3, acts="host", opt_offload="host", scaler="on")
    monkeypatch.setattr(loop_fuzz, "run", refusing("tierflow: cannot do this"))
    assert loop_fuzz.check(scaled).cause == "unnamed_refusal"
    monkeypatch.setattr(loop_fuzz, "run", refusing("tierflow: GradScaler is not supported with this setting"))
    assert loop_fuzz.check(scaled).kind == "refused"
