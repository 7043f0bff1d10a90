"""A training step leaves nothing behind: what the model and optimizer hold between steps is the same after every
step, with and without tierflow, under every activation mode (Note [Saved-tensor hook aliases] in
activations/runner.py).

Measured on an H200 (2026-11-26): with TIERFLOW_OFFLOAD_ACTIVATIONS=auto the 1.34B GPT held 9.7 GB more than the
baseline between steps, for good: the replays of the two profiling steps kept their autograd graphs alive (a saved
output packed as itself holds its own grad_fn). `recompute` leaked the same every step. On CUDA the check is the
caching allocator's count of allocated bytes; on the emulated device, the bytes of every tensor storage Python can
reach (the leaked tensors were reachable: their Python objects live as long as their C++ owners)."""

from __future__ import annotations

import gc

import pytest
import torch

import tierflow
from harness import gpt_task

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (scripts/setup.sh installs it); not importable here")

from test_model_zoo import ZOO  # noqa: E402  (the zoo's families, built the zoo's way)


def _held_bytes(device: str) -> int:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            storage = o.untyped_storage()
            try:
                storage.data_ptr()
            except RuntimeError:  # a parameter tierflow released (Note [Parameter storage]): no memory
                continue
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@pytest.mark.parametrize("acts", ["none", "host", "recompute", "auto"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_what_a_step_leaves_behind_does_not_grow(device, family, acts):
    task = gpt_task(layers=3, width=64) if family == "gpt" else ZOO[family][0]()
    torch.manual_seed(0)
    model = task.model_on(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierflow.wrap(model, opt, device=device, offload_activations=acts, offload_optimizer="none",
                               min_offload_bytes=0)
    held = []
    for i in range(6):  # auto profiles in steps 1 and 2 and plans before step 3
        task.loss(model, task.batch_on(i, device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        held.append(_held_bytes(device))
    # From the step after the plan on, nothing more is held: the optimizer's states exist from step 1.
    assert held[2:] == [held[2]] * 4, f"bytes held after each step grow: {held}"
    # ... and the profiling steps left nothing behind either: the same as after step 1 (states made, no plan yet).
    assert held[2] <= held[0], f"bytes held after each step: {held}"
    tierflow.unwrap(model)
