"""Note [Typed settings]: Python reads the C++ table's settings typed (tierflow._C.Settings), not as strings."""

import tierflow
from tierflow import _C
from tierflow._config import resolve_settings
from tierflow._wrap import Session

# Settings whose property is named apart from the keyword (the keyword's value is a choice of two).
RENAMED = {"weights_return": "weights_return_in_forward"}


def _as_text(name, value, text):
    """The typed `value` of variable `name` written as the table writes it, to hold it against `text`."""
    if isinstance(value, bool):
        if name == "TIERFLOW_WEIGHTS_RETURN":
            return "forward" if value else "step"
        return "on" if value else "off"
    if value is None:  # auto, or none for a clip
        return "none" if name == "TIERFLOW_MAX_GRAD_NORM" else "auto"
    if isinstance(value, list):
        return ",".join(value)
    if name == "TIERFLOW_STALL_TIMEOUT":  # seconds, 0 for none (Note [Stall timeout])
        return f"{value:g}s" if value else "none"
    if isinstance(value, float):
        return repr(value)
    if name == "TIERFLOW_CPU_THREADS" and value == 0:
        return "auto"
    return str(value)


def test_every_setting_is_a_typed_property_that_agrees_with_the_table():
    settings = resolve_settings(offload_optimizer="nvme", prefetch_bytes="4MiB", max_grad_norm=1.5,
                                overlap_step="off", grad_bucket_bytes="8MiB", weights_return="forward",
                                cpu_threads=3, gpu_optimizer_fraction="0.25", nvme_paths=["/a", "/b"],
                                partition_optimizer="on", replan="off", skip_nonfinite="on", aio_queue_depth=8)
    text = settings.to_strings()
    for row in tierflow.config_table():
        name = row["name"]
        keyword = name.removeprefix("TIERFLOW_").lower()
        value = getattr(settings, RENAMED.get(keyword, keyword))
        assert _as_text(name, value, text[name]) == text[name], (name, value, text[name])
    assert isinstance(settings.prefetch_bytes, int) and settings.prefetch_bytes == 4 << 20
    assert settings.overlap_step is False and settings.partition_optimizer is True and settings.replan is False
    assert settings.max_grad_norm == 1.5 and settings.gpu_optimizer_fraction == 0.25
    assert settings.grad_bucket_bytes == 8 << 20 and settings.weights_return_in_forward is True
    assert settings.offload_optimizer == "nvme" and settings.nvme_paths == ["/a", "/b"]


def test_defaults_are_typed_and_given_names_what_was_set():
    settings = resolve_settings(host_memory="1GiB")
    assert "TIERFLOW_HOST_MEMORY" in settings.given
    assert settings.given == set(_C.config_given({"host_memory": "1GiB"}))  # the environment's too
    assert settings.host_memory == "1073741824" and settings.gpu_memory == resolve_settings().gpu_memory
    assert settings.max_grad_norm is None and settings.grad_bucket_bytes is None
    assert settings.gpu_optimizer_fraction is None  # auto


def test_a_session_holds_its_settings_typed_beside_the_text():
    session = Session(prefetch_bytes="1MiB", offload_gradients="on", offload_optimizer="host")
    assert session.settings.prefetch_bytes == 1 << 20
    assert session.settings.offload_gradients is True
    assert session.config["TIERFLOW_PREFETCH_BYTES"] == "1048576"  # the text stays, for reports
