"""Issue 37, parts 3 and 5: errors that name the setting, raised at wrap or when the settings are parsed, losing
nothing. Each case through the keyword and, where there is one, the TIERFLOW_* variable."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.nn as nn

import tierflow
from tierflow import _C

ERRORS = (_C.ConfigError, _C.TierflowError, _C.OutOfMemoryError, _C.IOError, OSError, ValueError, TypeError)


def refused(how: str, monkeypatch, model: nn.Module = None, **settings) -> str:
    """wrap's error for ``settings`` given as keywords (how='keyword') or as TIERFLOW_* variables; checks that the
    model is unchanged and left unwrapped."""
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    before = {k: v.clone() for k, v in model.state_dict().items() if v.device.type != "meta"}
    kw = dict(settings) if how == "keyword" else {}
    if how == "environment":
        for k, v in settings.items():
            monkeypatch.setenv("TIERFLOW_" + k.upper(), ",".join(v) if isinstance(v, list) else str(v))
    with pytest.raises(ERRORS) as err:
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", **kw)
    assert getattr(model, "_tierflow_session", None) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
    assert "\n" not in str(err.value)
    return str(err.value)


BOTH = ["keyword", "environment"]

# Note [Settings a mode ignores]: ignoring these changes results or breaks a promise about memory.
IGNORED = [
    ({"offload_optimizer": "none", "skip_nonfinite": "on"}, "TIERFLOW_SKIP_NONFINITE", "skip_nonfinite"),
    ({"offload_optimizer": "none", "max_grad_norm": "1.0"}, "TIERFLOW_MAX_GRAD_NORM", "max_grad_norm"),
    ({"offload_optimizer": "none", "offload_gradients": "on"}, "TIERFLOW_OFFLOAD_GRADIENTS", "offload_gradients"),
    ({"offload_optimizer": "none", "partition_optimizer": "on"}, "TIERFLOW_PARTITION_OPTIMIZER",
     "partition_optimizer"),
]


@pytest.mark.parametrize("how", BOTH)
@pytest.mark.parametrize("settings, variable, keyword", IGNORED, ids=[c[2] for c in IGNORED])
def test_a_setting_the_mode_ignores_is_refused_naming_both(how, settings, variable, keyword, monkeypatch):
    msg = refused(how, monkeypatch, **settings)
    chooser = next(k for k in settings if k != keyword)
    assert f"{variable}=" in msg and f"(keyword {keyword})" in msg, msg
    assert f"TIERFLOW_{chooser.upper()}=" in msg and f"(keyword {chooser})" in msg, msg
    assert "accepted:" in msg, msg


# Speed only, or the integrity of a tier not in use (settings users set globally): accepted, one warning each.
WARNED = [
    ({"offload_activations": "none", "profile": "/tmp/tierflow-unused-profile.json"}, "TIERFLOW_PROFILE", "profile"),
    ({"offload_activations": "host", "replan": "off"}, "TIERFLOW_REPLAN", "replan"),
    ({"offload_activations": "none", "min_offload_bytes": "0"}, "TIERFLOW_MIN_OFFLOAD_BYTES", "min_offload_bytes"),
    ({"offload_activations": "none", "prefetch_bytes": "1MiB"}, "TIERFLOW_PREFETCH_BYTES", "prefetch_bytes"),
    ({"aio_queue_depth": "8"}, "TIERFLOW_AIO_QUEUE_DEPTH", "aio_queue_depth"),
    ({"aio_block_size": "4KiB"}, "TIERFLOW_AIO_BLOCK_SIZE", "aio_block_size"),
    ({"nvme_memory": "1GiB"}, "TIERFLOW_NVME_MEMORY", "nvme_memory"),
    ({"nvme_checksum": "off"}, "TIERFLOW_NVME_CHECKSUM", "nvme_checksum"),
    ({"offload_optimizer": "none", "grad_accumulation_steps": "4"}, "TIERFLOW_GRAD_ACCUMULATION_STEPS",
     "grad_accumulation_steps"),
    ({"overlap_step": "off", "grad_accumulation_steps": "4"}, "TIERFLOW_GRAD_ACCUMULATION_STEPS",
     "grad_accumulation_steps"),
    ({"offload_optimizer": "none", "overlap_step": "off"}, "TIERFLOW_OVERLAP_STEP", "overlap_step"),
    ({"overlap_step": "off", "grad_bucket_bytes": "8MiB"}, "TIERFLOW_GRAD_BUCKET_BYTES", "grad_bucket_bytes"),
    ({"overlap_step": "off", "weights_return": "forward"}, "TIERFLOW_WEIGHTS_RETURN", "weights_return"),
    ({"offload_optimizer": "none", "cpu_threads": "1"}, "TIERFLOW_CPU_THREADS", "cpu_threads"),
    ({"gpu_optimizer_fraction": "0.5"}, "TIERFLOW_GPU_OPTIMIZER_FRACTION", "gpu_optimizer_fraction"),
    ({"offload_activations": "none", "gpu_memory": "1GiB"}, "TIERFLOW_GPU_MEMORY", "gpu_memory"),
]


@pytest.mark.parametrize("how", BOTH)
@pytest.mark.parametrize("settings, variable, keyword", WARNED, ids=[f"{c[2]}-{next(iter(c[0]))}" for c in WARNED])
def test_a_speed_only_setting_the_mode_ignores_is_accepted_with_one_warning(how, settings, variable, keyword,
                                                                           monkeypatch, capfd):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    if how == "environment":
        for k, v in settings.items():
            monkeypatch.setenv("TIERFLOW_" + k.upper(), str(v))
    capfd.readouterr()
    tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated",
                  **(settings if how == "keyword" else {}))
    tierflow.unwrap(model)
    lines = [line for line in capfd.readouterr().err.splitlines() if "is ignored with" in line]
    assert len(lines) == 1, lines
    assert f"{variable}=" in lines[0] and f"(keyword {keyword})" in lines[0] and "no effect" in lines[0], lines


def test_settings_the_mode_uses_or_defaults_are_not_refused_nor_warned(monkeypatch, capfd):
    model = nn.Linear(4, 4)
    capfd.readouterr()
    tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", offload_optimizer="none",
                  skip_nonfinite="off", max_grad_norm="none", overlap_step="on", gpu_memory="90%")
    tierflow.unwrap(model)
    model = nn.Linear(4, 4)
    tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", max_grad_norm="1.0",
                  grad_accumulation_steps="2", profile="/tmp/tierflow-unused-profile.json", gpu_memory="1GiB")
    tierflow.unwrap(model)
    assert "is ignored with" not in capfd.readouterr().err


def test_a_list_where_one_value_is_expected_names_the_setting():
    model = nn.Linear(4, 4)
    with pytest.raises(_C.ConfigError) as err:
        tierflow.wrap(model, torch.optim.AdamW(model.parameters()), device="emulated", host_memory=["1GiB", "2GiB"])
    msg = str(err.value)
    assert "host_memory=['1GiB', '2GiB'] (TIERFLOW_HOST_MEMORY) is a list" in msg and "accepted: a size" in msg, msg
    assert tierflow.resolve_config(nvme_paths=["/a", "/b"])["TIERFLOW_NVME_PATHS"] == "/a,/b"  # a list setting


@pytest.mark.parametrize("how", BOTH)
def test_a_file_as_nvme_path_is_refused_when_parsed(how, tmp_path, monkeypatch):
    f = tmp_path / "a-file"
    f.write_text("")
    msg = refused(how, monkeypatch, offload_optimizer="nvme", nvme_paths=str(f))
    assert "TIERFLOW_NVME_PATHS=" in msg and "a-file': Not a directory" in msg and "accepted:" in msg, msg


@pytest.mark.parametrize("how", BOTH)
@pytest.mark.parametrize("twice", ["same", "slash", "link"])
def test_the_same_nvme_directory_twice_is_refused(how, twice, tmp_path, monkeypatch):
    d = tmp_path / "nvme"
    d.mkdir()
    other = {"same": str(d), "slash": str(d) + "/", "link": str(tmp_path / "link")}[twice]
    if twice == "link":
        os.symlink(d, other)
    msg = refused(how, monkeypatch, offload_optimizer="nvme", nvme_paths=[str(d), other])
    assert "TIERFLOW_NVME_PATHS=" in msg and "are the same directory" in msg, msg
    assert os.listdir(d) == [], "no swap file made"


def test_a_directory_without_o_direct_names_the_setting(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a ramfs (a file system without O_DIRECT)")
    mnt = os.path.join(os.path.dirname(__file__), "..", "..", "build", f"ramfs-{os.getpid()}")
    os.makedirs(mnt, exist_ok=True)
    if subprocess.run(["mount", "-t", "ramfs", "none", mnt], capture_output=True).returncode != 0:
        os.rmdir(mnt)
        pytest.skip("cannot mount a ramfs here")
    try:
        for how in BOTH:
            msg = refused(how, monkeypatch, offload_optimizer="nvme", nvme_paths=mnt)
            assert "TIERFLOW_NVME_PATHS (keyword nvme_paths)" in msg and "O_DIRECT" in msg and "accepted:" in msg, msg
            monkeypatch.delenv("TIERFLOW_NVME_PATHS", raising=False)
            monkeypatch.delenv("TIERFLOW_OFFLOAD_OPTIMIZER", raising=False)
    finally:
        import gc
        gc.collect()
        subprocess.run(["umount", mnt], capture_output=True)
        os.rmdir(mnt)


@pytest.mark.parametrize("how", BOTH)
def test_a_report_under_a_file_is_refused_when_parsed(how, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    msg = refused(how, monkeypatch, report=str(tmp_path / "a-file" / "sub" / "report.json"))
    assert "TIERFLOW_REPORT=" in msg and "a-file' on its way is not a directory" in msg and "accepted:" in msg, msg


def test_a_model_on_the_meta_device_is_refused_at_wrap(monkeypatch):
    with torch.device("meta"):
        model = nn.Linear(8, 8)
    msg = refused("keyword", monkeypatch, model=model)
    assert "meta device" in msg and "'weight' [8, 8]" in msg and "accepted:" in msg, msg


@pytest.mark.parametrize("how", BOTH)
@pytest.mark.parametrize("mode", ["auto", "none", "host", "recompute"])
def test_a_device_budget_below_the_parameters_is_refused_at_wrap(how, mode, monkeypatch):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])
    msg = refused(how, monkeypatch, model=model, gpu_memory="4KiB", offload_activations=mode)
    assert "TIERFLOW_GPU_MEMORY=4096 (keyword gpu_memory)" in msg and "130.00 KiB" in msg and "accepted:" in msg, msg
    if mode == "auto":
        assert "no activation plan can fit" in msg, msg
    else:
        assert f"TIERFLOW_OFFLOAD_ACTIVATIONS={mode} (keyword offload_activations) cannot keep" in msg, msg


def test_a_plan_profile_without_links_is_refused(tmp_path, capsys):
    import json

    from tierflow.__main__ import main
    from tierflow.activations.profile import profile_to_json

    shape = _C.TransformerShape(layers=3, hidden=64, heads=4, seq=8, batch=1, dtype_bytes=2, vocab=1000)
    profile = json.loads(profile_to_json(_C.estimate_transformer(shape, 1e12), _C.Links(d2h=2e10, h2d=2e10,
                                                                                         duplex=4e10), 0))
    profile["links"] = {}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    assert main(["plan", "--profile", str(path), "--gpu-memory", "16GiB"]) == 2
    err = capsys.readouterr().err
    assert "--profile" in err and "links has no positive d2h, h2d, duplex" in err and "accepted:" in err, err
