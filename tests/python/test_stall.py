"""Note [Stall timeout]: a copy that does not complete ends training with an error naming it, not a hang."""

import gc
import time

import pytest
import torch

import tierflow
from children import in_own_process
from harness import gpt_task


@pytest.mark.ordering
@in_own_process  # its 1 s limit is the process's: no other runtime may be alive (Note [Stall timeout])
def test_a_stalled_copy_raises_a_timeout_error_naming_it_within_the_limit():
    """Copies to the host held (a hung device, injected on the emulated device), TIERFLOW_STALL_TIMEOUT=1s
    (the least accepted).
    Backward does not wait for them (it reads the device copies of blocks still on their way), but releasing a
    block must, to free its staging: that wait stalls, is logged, and the block keeps its memory; the next
    offload raises tierflow's StallError (a TimeoutError) naming the copy and what is in flight, within the
    second step instead of never. Once the device goes on, the held copies end and tierflow lets go of all."""
    gc.collect()  # an earlier test's runtime in a reference cycle would hold the process's limit (10min)
    faults = tierflow._C.CopyFaults()
    faults.hold_d2h = True
    task = gpt_task(layers=1, width=32, block=16, batch=2, dropout=0.0)
    model = task.make_model()
    model, opt = tierflow.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="emulated",
                               offload_optimizer="none", offload_activations="host", min_offload_bytes=0,
                               stall_timeout="1s", _copy_faults=faults)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        for step in range(2):
            task.loss(model, task.batch_on(step, "emulated")).backward()
            opt.step()
            opt.zero_grad()
    took = time.monotonic() - t0
    assert isinstance(err.value, tierflow._C.StallError), type(err.value)
    text = str(err.value)
    assert "device -> host copy of" in text and "TIERFLOW_STALL_TIMEOUT=1 s" in text, text
    assert "In flight, oldest first:" in text, text
    # At the limit of the OLDEST copy (Note [Stall timeout]), not one limit later on a copy submitted after the
    # release that first waited only logged it; and that oldest copy, its age past the limit, is named first.
    assert took < 1.6, f"raised after {took:.2f} s"
    named = text.split(", which has not completed")[0].split(" has not completed")[0]
    age = float(named.rsplit(", ", 1)[1].split(" s old")[0])
    oldest = float(text.split("In flight, oldest first:\n  ")[1].split(" s old")[0].rsplit(", ", 1)[1])
    assert age >= 1.0 and age >= oldest - 0.05, f"names a {age} s old copy while a {oldest} s old one stalls: {text}"
    faults.hold_d2h = False
    tierflow.unwrap(model)


@pytest.mark.ordering  # the plan command measures the links: copies on the emulated device
@in_own_process
def test_the_plan_commands_measuring_runtime_takes_the_live_stall_limit(capsys):
    """Note [Stall timeout]: the limit is process-wide and a live runtime claims it; the plan command's runtime,
    made only to measure the links, is not refused for (nor changes) a wrapped model's limit."""
    gc.collect()
    model = torch.nn.Linear(8, 8)
    model, _ = tierflow.wrap(model, device="emulated", offload_optimizer="none", offload_activations="none",
                             stall_timeout="30s")
    from tierflow.cli import main

    rc = main(["plan", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "32", "--batch",
               "2", "--gpu-memory", "1GiB"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert tierflow.current_session().settings.stall_timeout == 30.0
    tierflow.unwrap(model)
