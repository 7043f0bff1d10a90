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
    step()'s wait for the CPU optimizer is measured, and the whole step is near the measured one (the median of the
    steps since the plan)."""
    reports = []
    train(gpt_task(), 8, True, device=device, offload_activations="auto", offload_optimizer="host",
          min_offload_bytes="0", after_step=lambda i: reports.append(tierflow.report()["plan"]))
    plan = reports[-1]  # while the optimizer is alive
    terms = plan["terms"]
    assert list(terms) == TERMS, terms
    assert all(set(t) == {"predicted_s", "measured_s"} for t in terms.values()), terms
    parts = sum(terms[k]["predicted_s"] for k in TERMS[:-1])
    assert parts == pytest.approx(terms["total"]["predicted_s"]) == pytest.approx(plan["predicted_step_seconds"])
    assert terms["optimizer"]["measured_s"] is not None and terms["optimizer"]["measured_s"] >= 0
    assert terms["total"]["measured_s"] == plan["measured"]["step_seconds"]
    # The target is 25% (issue 41); the prediction rests on one timed step, and on a loaded 2-core machine a run
    # strays up to 1.5x (benchmarks/plan_prediction_check.py gives the spread per mode): what this asserts without
    # flaking is the factor of 2 that a prediction missing a term (the head, the optimizer) would break.
    ratio = terms["total"]["predicted_s"] / terms["total"]["measured_s"]
    assert 0.5 <= ratio <= 2.0, (ratio, terms, plan.get("timed_step"))
