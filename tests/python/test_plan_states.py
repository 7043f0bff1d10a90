"""``python -m tierflow plan --optimizer-states``: the CPU AdamW's host bytes a parameter from the format (issue 39;
Note [Transformer estimate], Optimizer states). The counts themselves are tested in C++
(tests/cpp/test_plan_state_format.cpp); here, that the flag and TIERFLOW_OPTIMIZER_STATES reach them."""

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout

import pytest

from tierflow import _C
from tierflow.__main__ import main as tierflow_main

SMALL = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--batch", "2", "--vocab", "1000",
         "--gpu-memory", "16GiB", "--tflops", "100", "--pcie-gbps", "20", "--optimizer", "host"]
PARAMS = _C.transformer_parameters(_C.TransformerShape(layers=4, hidden=256, heads=4, seq=128, batch=2,
                                                       dtype_bytes=2, vocab=1000, ffn_mult=4))
# 13 bytes a parameter: the CPU AdamW's pinned pool is its states and one step's bf16 gradients and new weights in
# staging (about 4 bytes a parameter: optimizer::state_pool_need), so fp32 states (12 + 4) do not fit, 8bit's
# (6 + 8/256 + 4) do.
HOST_BYTES = 13 * PARAMS
HOST = ["--host-memory", str(HOST_BYTES)]
EIGHT_BIT_BYTES = 6 * PARAMS + 8 * -(-PARAMS // 256)


def plan(args, monkeypatch, states_variable=None):
    """(exit code, stdout, stderr) of ``python -m tierflow plan ARGS`` in this process."""
    if states_variable is None:
        monkeypatch.delenv("TIERFLOW_OPTIMIZER_STATES", raising=False)
    else:
        monkeypatch.setenv("TIERFLOW_OPTIMIZER_STATES", states_variable)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = tierflow_main(["plan", *args])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("flag, variable", [(["--optimizer-states", "8bit"], None), ([], "8bit"),
                                            (["--optimizer-states", "8BIT"], "fp32")])
def test_eight_bit_states_fit_a_host_budget_fp32_states_do_not(monkeypatch, flag, variable):
    rc, out, err = plan([*SMALL, *HOST, "--json", *flag], monkeypatch, variable)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["state"]["host_bytes"] == EIGHT_BIT_BYTES
    pinned = doc["state"]["pinned_host_bytes"]  # the states and the staging
    assert EIGHT_BIT_BYTES + 4 * PARAMS <= pinned < EIGHT_BIT_BYTES + 5 * PARAMS, doc["state"]
    assert doc["budgets"]["host_bytes_for_activations"] == HOST_BYTES - pinned
    rc, out, err = plan([*SMALL, *HOST, *flag], monkeypatch, variable)
    assert rc == 0, err
    assert "; CPU AdamW states --optimizer-states 8bit: 6.03 bytes a parameter," in out


@pytest.mark.parametrize("flag, variable", [([], None), (["--optimizer-states", "fp32"], "8bit")])
def test_fp32_states_are_refused_naming_the_format_that_fits(monkeypatch, flag, variable):
    rc, out, err = plan([*SMALL, *HOST, *flag], monkeypatch, variable)
    assert rc == 2 and out == "", (out, err)
    needs = re.search(r"it needs (\d+) bytes \(--optimizer-states fp32, with one step's gradients", err)
    assert needs and 16 * PARAMS <= int(needs.group(1)) < 17 * PARAMS, err  # 12 of states, ~4 of staging
    assert "or --optimizer-states 8bit (TIERFLOW_OPTIMIZER_STATES=8bit: 6.03 bytes a parameter" in err, err


def test_a_bad_format_names_the_flag_and_what_is_accepted(monkeypatch):
    rc, out, err = plan([*SMALL, *HOST, "--optimizer-states", "4bit"], monkeypatch)
    assert rc == 2 and out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("tierflow plan: --optimizer-states='4bit'") and "one of fp32, bf16, 8bit" in err, err


def test_the_8bit_hint_is_given_only_where_8bit_states_fit(monkeypatch):
    """A host budget too small even for 8-bit states: the refusal does not suggest them (the review found it
    suggested 38.56 GiB of 8-bit states for an 11.77 GiB budget)."""
    small = ["--host-memory", str(5 * PARAMS)]  # below 8bit's 6.03 bytes a parameter
    rc, _, err = plan(SMALL + small + ["--optimizer-states", "fp32"], monkeypatch)
    assert rc == 2 and "cannot hold the optimizer states" in err, err
    assert "--optimizer-states 8bit" not in err, err
