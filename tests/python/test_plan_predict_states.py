"""benchmarks/gpu_offload_predict.py with TIERFLOW_OPTIMIZER_STATES (issue 39): the CPU AdamW's rate and the host's
bytes per format in the llama7b prediction (arithmetic only; nothing here is measured)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
try:
    import gpu_offload_predict as gp
finally:
    sys.path.pop(0)

CFG = dict(n_layer=32, d_model=4096, seq_len=4096, batch=1, mlp_hidden=11008, mlp="swiglu")
D, H, N = 4096, 11008, 6_755_983_360
BLOCK = 4 * D * D + 4 * D + 2 * 2 * D + 3 * D * H
BUDGET = 16 << 30


def test_each_format_steps_at_the_fp32_rate_times_its_floor_capped_by_its_compute():
    ceilings, _ = gp.measured_ceilings()
    for states, step_bytes, state_bytes in (("fp32", 28, 12), ("bf16", 20, 8), ("8bit", 16 + 16 / 256, 6 + 8 / 256)):
        pred = gp.predict_params_offload(CFG, N, BLOCK, BUDGET, states)
        rate = min(5.0e9 * 28 / step_bytes, 16 * ceilings[states])
        assert pred["cpu_adamw_seconds"] == pytest.approx(N / rate)
        one = pred["by_batch"]["1"]
        # bf16 weights and gradients on the host, the states, and the activations swapped at batch 1.
        assert one["host_bytes_estimate"] == pytest.approx(N * (4 + state_bytes) + pred["swapped_activation_bytes_estimate"])
        assert one["fits_host"]
        floor = gp.predict_params_offload(CFG, N, BLOCK, BUDGET, states, capped=False)
        assert floor["cpu_adamw_seconds"] == pytest.approx(N * step_bytes / 28 / 5.0e9)
    with pytest.raises(ValueError, match="one of fp32, bf16, 8bit"):
        gp.predict_params_offload(CFG, N, BLOCK, BUDGET, "4bit")


def test_fp32_at_batch_1_is_the_prediction_the_docs_carried():
    pred = gp.predict_params_offload(CFG, N, BLOCK, BUDGET)
    assert pred["step_seconds"] == pytest.approx(1.596, abs=5e-4)
    assert pred["mfu"] == pytest.approx(0.105, abs=5e-4)
    assert pred["bound_by"] == "forward link + CPU AdamW"
    assert pred["recomputed_activation_bytes_estimate"] == 0


def test_smaller_states_leave_the_host_room_to_swap_within_the_nodes_memory():
    fp32 = gp.predict_params_offload(CFG, N, BLOCK, BUDGET, "fp32")["by_batch"]
    eight = gp.predict_params_offload(CFG, N, BLOCK, BUDGET, "8bit")["by_batch"]
    room = gp.HOST_BYTES - gp.HOST_RESERVE_BYTES
    for b in fp32:
        assert fp32[b]["host_bytes_estimate"] <= room * (1 + 1e-12) and eight[b]["host_bytes_estimate"] <= room * (1 + 1e-12)
        assert eight[b]["step_seconds"] <= fp32[b]["step_seconds"] * (1 + 1e-12)
    # At batch 4 fp32's states leave the host 20.8 GB for activations; 8bit's leave room the link fills.
    assert fp32["4"]["swapped_activation_bytes_estimate"] < eight["4"]["swapped_activation_bytes_estimate"]
    assert fp32["4"]["host_bytes_estimate"] == pytest.approx(room)
    # Batch 1 swaps what does not fit the device (the link has time); batch 4 recomputes what the host or the
    # forward's link cannot take.
    assert eight["1"]["recomputed_activation_bytes_estimate"] == 0
    assert eight["4"]["recomputed_activation_bytes_estimate"] > 0


def test_a_format_slower_than_its_floor_is_capped_by_its_compute(monkeypatch):
    """Where 16 threads at the measured ceiling a thread step slower than the memory floor (a 2-core machine's
    8-bit kernel is compute-bound), the prediction takes the compute rate."""
    monkeypatch.setattr(gp, "measured_ceilings", lambda: ({"fp32": 1e9, "bf16": 1e8, "8bit": 1e8}, "test"))
    pred = gp.predict_params_offload(CFG, N, BLOCK, BUDGET, "8bit")
    assert pred["cpu_adamw"]["capped_by"] == "compute"
    assert pred["cpu_adamw_seconds"] == pytest.approx(N / (16 * 1e8))
