"""Note [Step prediction]: the whole step predicted term by term; `auto`'s report puts each term's prediction
beside its measurement (issue 41; the spread of predicted / measured over several runs per mode is
benchmarks/plan_prediction_check.py's)."""

import pytest

import tierflow
from tierflow import _C
from harness import gpt_task, train

TERMS = ["compute", "activation_copies", "parameter_fetches", "gradient_copies", "optimizer", "rest", "total"]


def test_the_cpu_adam_rate_is_measured_with_tierflows_kernel_per_format():
    for states in ("fp32", "bf16", "8bit"):
        assert _C.measure_cpu_adam_rate(states, seconds=0.01, parameters=1 << 16, threads=1) > 1e6
    with pytest.raises(_C.ConfigError, match="TIERFLOW_OPTIMIZER_STATES"):
        _C.measure_cpu_adam_rate("fp16")
    # A rate given for fp32 states, as another format steps (the bytes a parameter moved: 28, 20, 16.06).
    assert _C.cpu_adam_step_bytes_per_param("bf16", 2) == 20.0


def test_auto_reports_each_terms_prediction_beside_its_measurement(device):
    """The CPU AdamW streamed during backward, every block kept: the terms add up to the whole step predicted,
    step()'s wait for the CPU optimizer is measured, and the whole step, its rest taken from the plan's own steps
    (Note [Rest calibration]), is near the median of the steps after those (held out)."""
    reports = []
    held_out = 6
    steps = 2 + _C.REST_CALIBRATION_SKIP + _C.REST_CALIBRATION_STEPS + held_out  # planned before the 3rd
    train(gpt_task(), steps, True, device=device, offload_activations="auto", offload_optimizer="host",
          min_offload_bytes="0", after_step=lambda i: reports.append(tierflow.report()["plan"]))
    plan = reports[-1]  # while the optimizer is alive
    terms = plan["terms"]
    assert list(terms) == TERMS, terms
    assert all(set(t) == {"predicted_s", "measured_s"} for t in terms.values()), terms
    parts = sum(terms[k]["predicted_s"] for k in TERMS[:-1])
    assert parts == pytest.approx(terms["total"]["predicted_s"]) == pytest.approx(plan["predicted_step_seconds"])
    assert terms["optimizer"]["measured_s"] is not None and terms["optimizer"]["measured_s"] >= 0
    # step()'s wait split: the worker's wait for gradient copies after backward ended, the rest the optimizer's.
    assert terms["gradient_copies"]["measured_s"] is not None and terms["gradient_copies"]["measured_s"] >= 0, terms
    # The optimizer's term per optimizer step, the others per forward (one each here: the forward the plan came in
    # force before is among both, its waits counted after the counters were read).
    over = plan["terms_measured_over"]
    assert over["optimizer_steps"] - 1 <= over["steps"] <= over["optimizer_steps"] and over["steps"] > 0, over
    assert over["steps"] == over["optimizer_steps"], over
    assert "gradient copies" in over["gradient_copies"] and "less the gradient copies" in over["optimizer"], over
    assert terms["total"]["measured_s"] == plan["measured"]["step_seconds"]
    # The rest came from the plan's steps after its first few, and only the steps after them are measured beside.
    calibration = plan["rest_calibration"]
    assert calibration is not None and calibration["steps"] == _C.REST_CALIBRATION_STEPS, plan
    assert calibration["timed_rest_seconds"] == plan["timed_step"]["rest_of_step_seconds"]
    assert plan["measured"]["steps"] == held_out - 1, plan  # gaps between the held-out steps' forwards
    assert reports[-held_out - 1]["rest_calibration"] is None, reports[-held_out - 1]
    # The target is 25% (issue 41; benchmarks/plan_prediction_check.py gives the spread per mode, and
    # benchmarks/results/plan_prediction_tiny_*.json holds a quiet run's): on a loaded CI machine a median of a few
    # held-out steps strays further, so this asserts 1.5x, which a rest from the timed step alone broke by itself
    # on a quiet machine only at times (1.4x).
    ratio = terms["total"]["predicted_s"] / terms["total"]["measured_s"]
    assert 1 / 1.5 <= ratio <= 1.5, (ratio, terms, calibration)


def test_step_waits_are_split_between_the_gradient_copies_and_the_optimizer():
    """report()["plan"]["terms"] from the counters (AutoPlanner._measured_terms over stand-in counters): step()'s
    wait per optimizer step is the gradient copies' term up to the worker's wait for them after backward ended, the
    optimizer's the rest; a copy wait longer than step()'s (it began before step() did) is capped at it."""
    from types import SimpleNamespace

    from tierflow.activations.autoplan import AutoPlanner

    then = {"forwards": 3, "optimizer_steps": 2, "param_wait_ms": None, "activation_wait_ms": 1.0,
            "step_wait_ms": 10.0, "grad_copy_wait_ms": 4.0, "kernel_ms": 0.0, "kernel_grad_bytes": 0,
            "streaming": True}

    def terms(step_wait_ms: float, grad_copy_wait_ms: float) -> dict:
        now = dict(then, forwards=7, optimizer_steps=6, activation_wait_ms=9.0, step_wait_ms=10.0 + step_wait_ms,
                   grad_copy_wait_ms=4.0 + grad_copy_wait_ms)
        out = {"terms": {k: {"predicted_s": 0.0} for k in TERMS}, "measured": {"step_seconds": 0.25}}
        AutoPlanner._measured_terms(SimpleNamespace(_wait_counters=lambda: now, _plan_counters=then), out)
        return {k: t["measured_s"] for k, t in out["terms"].items()}

    t = terms(4 * 50.0, 4 * 20.0)  # 4 optimizer steps: 50 ms of step() waits each, 20 of them for copies
    assert t["gradient_copies"] == pytest.approx(0.020) and t["optimizer"] == pytest.approx(0.030), t
    assert t["activation_copies"] == pytest.approx(0.002) and t["total"] == 0.25, t
    t = terms(4 * 50.0, 4 * 80.0)
    assert t["gradient_copies"] == pytest.approx(0.050) and t["optimizer"] == pytest.approx(0.0), t


def test_measured_compute_counts_only_the_replays_the_plan_does():
    """The timed step replays every block; the measured compute counts a recompute block's replay, a split block's
    share of it, keep and swap none (the profiling's replays made a keep-all plan's compute exceed the whole step),
    and none after a batch-growth re-plan (the timed step ran another batch)."""
    from tierflow.activations.autoplan import measured_compute

    block = {"forward_seconds": 4.0, "split_recompute_seconds": 2.0, "cheap_recompute_seconds": 1.0}
    timed = {"blocks_forward_seconds": 10.0, "blocks_backward_seconds": 20.0, "blocks_replay_seconds": 12.0,
             "blocks": [block] * 4}
    plan = {"timed_step": timed, "modes": ["keep", "swap", "recompute", "split"], "alpha": [0, 0, 0, 0.5],
            "batch_elements": 512, "profiled_batch_elements": 512}
    compute, over = measured_compute(plan, [3.0] * 4)
    assert compute == pytest.approx(30.0 + 3.0 + 3.0 * (2.0 * 0.5 + 1.0) / 4.0), (compute, over)
    assert "replays the plan in force does" in over
    assert measured_compute(dict(plan, modes=["keep"] * 4), [3.0] * 4)[0] == pytest.approx(30.0)
    compute, over = measured_compute(dict(plan, batch_elements=1536), [3.0] * 4)
    assert compute is None and "1536" in over, over
    assert measured_compute(plan, [3.0, 3.0, None, 3.0])[0] is None


def test_terms_measured_over_names_every_term():
    from types import SimpleNamespace

    from tierflow.activations.autoplan import AutoPlanner

    counters = {"forwards": 3, "optimizer_steps": 2, "param_wait_ms": None, "activation_wait_ms": 1.0,
                "step_wait_ms": 10.0, "grad_copy_wait_ms": 4.0, "kernel_ms": 0.0, "kernel_grad_bytes": 0,
                "streaming": True}
    out = {"terms": {k: {"predicted_s": 0.0} for k in TERMS}, "measured": {"step_seconds": 0.25}}
    AutoPlanner._measured_terms(SimpleNamespace(_wait_counters=lambda: dict(counters, forwards=4),
                                                _plan_counters=counters), out)
    assert set(TERMS) - {"rest"} <= set(out["terms_measured_over"]), out["terms_measured_over"]


def test_the_python_paths_step_is_the_optimizers_measurement():
    """step()'s Python path (gradient accumulation's every parameter; all of it without a gradient stream) is in
    the optimizer's measured term, per optimizer step, with a stream and without one."""
    from types import SimpleNamespace

    from tierflow.activations.autoplan import AutoPlanner

    then = {"forwards": 3, "optimizer_steps": 2, "param_wait_ms": None, "activation_wait_ms": 1.0,
            "step_wait_ms": 10.0, "grad_copy_wait_ms": 4.0, "kernel_ms": 0.0, "kernel_grad_bytes": 0,
            "python_step_ms": 5.0}
    for streaming, expected in ((True, 0.030 + 0.012), (False, 0.012)):
        now = dict(then, forwards=7, optimizer_steps=6, step_wait_ms=10.0 + 4 * 50.0, grad_copy_wait_ms=4.0 + 80.0,
                   python_step_ms=5.0 + 4 * 12.0, streaming=streaming)
        out = {"terms": {k: {"predicted_s": 0.0} for k in TERMS}, "measured": {"step_seconds": 0.25}}
        AutoPlanner._measured_terms(SimpleNamespace(_wait_counters=lambda: now,
                                                    _plan_counters=dict(then, streaming=streaming)), out)
        assert out["terms"]["optimizer"]["measured_s"] == pytest.approx(expected), (streaming, out["terms"])


def test_without_a_gradient_stream_the_cpu_step_is_predicted_in_step():
    """overlap_step=off: the CPUAdamW steps all in step(); the prediction has it on the CPU, not during backward,
    at the rate its Python path stepped in the timed step (AutoPlanner._optimizer_inputs over stand-in counters)."""
    from types import SimpleNamespace

    import torch

    from tierflow.activations.autoplan import AutoPlanner

    me = SimpleNamespace(model_params=[torch.zeros(1000, requires_grad=True)],
                         session=SimpleNamespace(settings=SimpleNamespace(optimizer_states="fp32")))
    before = {"streaming": False, "python_step_ms": 2.0, "adam_elements": 500}
    o = AutoPlanner._optimizer_inputs(me, before, dict(before, python_step_ms=6.0, adam_elements=1500))
    assert o.on_cpu and not o.steps_during_backward and o.parameters == 1000, o
    assert o.params_per_second == pytest.approx(1000 / 0.004)
    assert not AutoPlanner._optimizer_inputs(me, {}, {"streaming": False, "python_step_ms": None}).on_cpu
