"""``python -m tierflow plan --model PATH`` (Note [Model families], Note [Plan fit]): every zoo family's default
config.json plans, the output has the bytes per tier by kind and tokens a second, a plan that does not fit names the
settings that would (tried by the planner) with the command line, and a bad config is one line naming the file and
the field, exit code 2. In process through tierflow.__main__.main (no torch is needed for a config)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest

from tierflow.__main__ import main as tierflow_main

RATES = ["--tflops", "400", "--pcie-gbps", "55", "--cpu-adam-rate", "5e9", "--host-memory", "512GiB"]
LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def plan(*args):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = tierflow_main(["plan", *args])
    return rc, out.getvalue(), err.getvalue()


def write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def expect_one_line(rc, out, err, *needles):
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith("tierflow plan: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_a_config_directory_plans_with_bytes_per_tier_and_tokens_a_second(tmp_path):
    write(tmp_path, LLAMA)
    rc, out, err = plan("--model", str(tmp_path), "--gpu-memory", "80GiB", *RATES)
    assert rc == 0, err
    assert out.startswith(f"config: Llama (llama) from {tmp_path}/config.json: 6.74B parameters, 32 layers"), out
    assert "--seq 2048 --batch 1 --dtype bf16" in out  # max_position_embeddings, 1, torch_dtype
    assert "bytes per tier:" in out and "pinned host" in out and "tokens/s: " in out
    rc, out, err = plan("--model", str(tmp_path), "--gpu-memory", "80GiB", "--seq", "512", "--batch", "2", "--json",
                        *RATES)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["model"]["parameters"] == 6738415616 and doc["model"]["seq"] == 512 and doc["model"]["batch"] == 2
    tiers = doc["bytes_per_tier"]
    assert tiers["device"]["total"] == doc["predicted"]["gpu_peak_bytes"]
    assert tiers["device"]["parameters"] == tiers["device"]["gradients"] == 2 * 6738415616
    # --optimizer host: master, m, v, and one step's bf16 gradients and new weights in pinned staging (the runtime's
    # optimizer::state_pool_need, each tensor rounded up to the pool's 4 KiB pages)
    pinned = tiers["pinned_host"]["optimizer_states"]
    assert pinned == doc["state"]["pinned_host_bytes"] and 16 * 6738415616 <= pinned < 16 * 6738415616 + 2 ** 24
    assert doc["tokens_per_second"] == pytest.approx(1024 / doc["step"]["terms_seconds"]["total"])


def test_every_zoo_familys_default_config_plans(tmp_path):
    transformers = pytest.importorskip("transformers")
    classes = [transformers.LlamaConfig, transformers.MistralConfig, transformers.Qwen2Config, transformers.Qwen3Config,
               transformers.GemmaConfig, transformers.Phi3Config, transformers.GPT2Config, transformers.MixtralConfig,
               transformers.Qwen3MoeConfig]
    for cls in classes:
        path = write(tmp_path, cls().to_json_string(use_diff=True), f"{cls.__name__}.json")
        rc, out, err = plan("--model", path, "--seq", "1024", "--gpu-memory", "1000GiB", "--json", *RATES,
                            "--host-memory", "4TiB")  # Mixtral's 46.7B parameters: 560 GB of fp32 states
        assert rc == 0, (cls.__name__, err)
        doc = json.loads(out)
        assert doc["model"]["model_type"] == cls().model_type
        assert doc["bytes_per_tier"]["device"]["total"] == doc["predicted"]["gpu_peak_bytes"], cls.__name__


def test_a_plan_that_does_not_fit_names_the_settings_that_would_and_the_command(tmp_path):
    # Llama-7B at 16 GiB without --offload-params: the planner tries the settings and prints the fastest that fits.
    path = write(tmp_path, LLAMA)
    rc, out, err = plan("--model", path, "--gpu-memory", "16GiB", *RATES)
    expect_one_line(rc, out, err, "no activation plan fits", "; it fits with --",
                    "(tried by the planner: predicted step ",
                    f"python -m tierflow plan --model {path} --gpu-memory 16GiB --tflops 400")
    command = err.split("): python -m tierflow plan ", 1)[1].split()
    rc, out, err = plan(*command)  # the command line it prints fits
    assert rc == 0, err
    # Nothing fits 1 GiB: it says so.
    rc, out, err = plan("--model", path, "--gpu-memory", "1GiB", *RATES)
    expect_one_line(rc, out, err, "none of the", "combinations", "tried fits")


def test_the_issues_llama7b_shape_names_the_setting_that_makes_it_fit():
    # Issue 41: without --offload-params the llama7b shape at 16 GiB said "no activation plan fits" and no more.
    shape = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "4096", "--batch", "1", "--vocab", "32000"]
    rc, out, err = plan(*shape, "--gpu-memory", "16GiB", *RATES)
    # The gradients freed once copied (--offload-gradients on, TIERFLOW_OFFLOAD_GRADIENTS) make it fit without
    # fetching the parameters, which costs time: the search tries both.
    expect_one_line(rc, out, err, "no activation plan fits", "; it fits with --", "--offload-gradients on",
                    "python -m tierflow plan --layers 32 ")
    rc, out, err = plan(*err.split("): python -m tierflow plan ", 1)[1].split())
    assert rc == 0, err


def test_offload_gradients_mirrors_the_setting(tmp_path, monkeypatch):
    # --offload-gradients on|off (TIERFLOW_OFFLOAD_GRADIENTS, parsed by the table's parser): on leaves the two
    # largest units' gradients on the device (Note [Plan report], Gradients); a bad value names the flag.
    path = write(tmp_path, dict(LLAMA, num_hidden_layers=2))
    block = 202383360 * 2  # a Llama-7B layer's bf16 parameters
    rest = 2 * 32000 * 4096 * 2 + 4096 * 2  # embeddings, head, final norm
    docs = {}
    for value in ("off", "on"):
        rc, out, err = plan("--model", path, "--seq", "256", "--gpu-memory", "80GiB", "--json", *RATES,
                            "--offload-gradients", value)
        assert rc == 0, err
        docs[value] = json.loads(out)
    assert docs["off"]["bytes_per_tier"]["device"]["gradients"] == 2 * block + rest
    assert docs["on"]["bytes_per_tier"]["device"]["gradients"] == block + rest
    assert docs["on"]["state"]["offload_gradients"] is True and docs["off"]["state"]["offload_gradients"] is False
    assert docs["off"]["predicted"]["gpu_peak_bytes"] - docs["on"]["predicted"]["gpu_peak_bytes"] == block
    monkeypatch.setenv("TIERFLOW_OFFLOAD_GRADIENTS", "on")  # the setting's default
    rc, out, err = plan("--model", path, "--seq", "256", "--gpu-memory", "80GiB", "--json", *RATES)
    assert rc == 0 and json.loads(out)["state"]["offload_gradients"] is True, err
    expect_one_line(*plan("--model", path, "--gpu-memory", "80GiB", *RATES, "--offload-gradients", "yes"),
                    "--offload-gradients='yes' is not valid; accepted: on or off")
    expect_one_line(*plan("--model", path, "--gpu-memory", "80GiB", *RATES[:4], "--offload-gradients", "on",
                          "--optimizer", "none"),  # no --cpu-adam-rate: refused with --optimizer none, first
                    "--offload-gradients on (TIERFLOW_OFFLOAD_GRADIENTS) with --optimizer none", "accepted: ")


@pytest.mark.parametrize("why, config, extra, needles", [
    ("no such file", None, [], ["missing.json': cannot be read (no such file); accepted: a directory holding a "
                                "transformers config.json"]),
    ("not JSON", "{", [], ["--model '", "not JSON"]),
    ("an unknown model_type", {"model_type": "bert", "vocab_size": 3}, [],
     ["model_type 'bert' is not one tierflow plan reads; accepted: llama, mistral, qwen2, qwen3, gemma, phi3, gpt2, "
      "mixtral, qwen3_moe"]),
    ("a missing field", {k: v for k, v in LLAMA.items() if k != "num_attention_heads"}, [],
     ["num_attention_heads is missing; accepted: a config.json of model_type 'llama' with num_attention_heads"]),
    ("a field of another type", dict(LLAMA, hidden_size="4096"), [], ["hidden_size \"4096\" is not an integer"]),
    ("--model beside a shape", LLAMA, ["--layers", "2"], ["--model", "with --layers", "accepted: --model PATH"]),
    ("--vocab with --model", LLAMA, ["--vocab", "100"], ["--vocab and --ffn-mult come from the config"]),
    ("a bad --cpu-adam-rate", LLAMA, ["--cpu-adam-rate", "fast"],
     ["--cpu-adam-rate: 'fast' is not valid; accepted: parameters a second"]),
])
def test_a_bad_config_is_one_line_naming_the_file_and_the_field(tmp_path, why, config, extra, needles):
    path = str(tmp_path / "missing.json") if config is None else write(tmp_path, config)
    expect_one_line(*plan("--model", path, "--gpu-memory", "80GiB", "--tflops", "400", "--pcie-gbps", "55", *extra),
                    *needles)
