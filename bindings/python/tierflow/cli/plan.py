"""``python -m tierflow plan``: what fits, and how fast, from a transformer shape, a transformers config.json
(``--model PATH``, Note [Model families] in tiering/model_config.hpp) or a recorded profile.

With ``--model``, --seq defaults to the config's max_position_embeddings (GPT-2: n_positions) capped at 4096,
--batch to 1 and --dtype to the config's torch_dtype (else bf16); the output adds the bytes per tier by kind and
tokens a second, and a plan that does not fit names the settings that would (tried by the planner, Note [Plan fit]).

The planner itself is C++ (tiering/planner.hpp, Note [Activation planner]); this
module gathers its inputs (an estimated or recorded block profile, link
bandwidths through torch, the settings' texts), runs it and prints the plan; the
budgets and the report are tiering's too (tiering/plan_report.hpp, Note [Plan report]). The profile file it
reads with ``--profile`` is tiering's (tiering/profile_file.hpp, Note [Profile file]).

Errors
------
Every bad argument, profile or ``TIERFLOW_*`` variable is one line on stderr
naming it, its value and what is accepted, and exit code 2; with ``--json`` the
same line is also a JSON object ``{"error": ...}`` on stdout. Sizes go through the
configuration table's own parsers (``--gpu-memory`` as ``TIERFLOW_GPU_MEMORY``,
``--host-memory`` as ``TIERFLOW_HOST_MEMORY``, ``--prefetch`` as
``TIERFLOW_PREFETCH_BYTES``; ``--optimizer-states`` as ``TIERFLOW_OPTIMIZER_STATES``), shape arguments are checked against
``transformer_shape_limits()`` before anything is built, and rates by
tiering::check_rate (Note [Plan report]).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

from .. import _native as _C  # tierflow._core's names (torch-free); any other loads torch, then tierflow._C
from .._config import resolve_settings
from .._native import profile_from_json  # tiering's parser; tierflow.activations imports torch

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ---- measurements ----------------------------------------------------------------------------

def measure_flops(cuda: bool) -> float:
    """Matmul flops per second on the device tierflow would use (bf16 on a GPU, fp32 on the CPU)."""
    import torch
    if cuda:
        n, dtype, repeats, device = 8192, torch.bfloat16, 20, "cuda"
    else:
        n, dtype, repeats, device = 512, torch.float32, 5, "cpu"
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.mm(a, b)  # warm-up
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    if cuda:
        torch.cuda.synchronize()
    return 2.0 * n ** 3 * repeats / (time.perf_counter() - t0)


def measure_links(cuda: bool) -> Any:
    """Device<->host bandwidths through tierflow's copy engine: the probe ``auto`` runs at its profiling step
    (tierflow._links.measure_links), on a runtime of the environment's settings with the activation and optimizer
    tiers off (no pinned states, no swap files), no trace, and the stall limit of a wrapped model alive in this
    process if there is one (the limit is process-wide, Note [Stall timeout]: a runtime made only to measure
    must not be refused for, or change, the live one's)."""
    import torch

    from .._links import measure_links as engine_links
    from .._wrap import _live_sessions

    settings = {"TIERFLOW_OFFLOAD_ACTIVATIONS": "none", "TIERFLOW_OFFLOAD_OPTIMIZER": "none",
                "TIERFLOW_NVME_PATHS": "", "TIERFLOW_TRACE": ""}
    live = [s.settings.stall_timeout for s in _live_sessions()]
    if live:
        settings["TIERFLOW_STALL_TIMEOUT"] = repr(live[-1]) if live[-1] > 0 else "none"
    runtime = _C.Runtime(settings)
    links = engine_links(runtime, torch.device("cuda" if cuda else "cpu"))
    return _C.Links(d2h=links["d2h"], h2d=links["h2d"], duplex=links["duplex"])


# ---- the command -----------------------------------------------------------------------------

class PlanError(Exception):
    """A user error: printed and exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a PlanError (one line, exit code 2) rather than usage text and exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlanError(message)


def _text(flag: str, text: str) -> str:
    """An argument that goes to C++: text that encodes as UTF-8 (argv may hold undecodable bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PlanError(f"{flag} {_shown(text)} is not valid; accepted: UTF-8 text") from None
    return text


def _shown(text: str) -> str:
    """A value as quoted in a message: repr, cut to a readable length."""
    r = repr(text)
    return r if len(r) <= 42 else r[:38] + "...'"


def _shape_int(field: str) -> Callable[[str], int]:
    """argparse type of a shape argument: a decimal integer within transformer_shape_limits()
    (tiering::shape_argument)."""
    def parse(text: str) -> int:
        digits = text.strip()
        try:
            return _C.shape_argument(field, digits if digits.isascii() else "", _shown(text))
        except _C.ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _rate(zero: bool) -> Callable[[str], float]:
    """argparse type of a rate (tiering::check_rate; or 0 when `zero`), no inf or nan."""
    def parse(text: str) -> float:
        try:
            return _C.check_rate(_C.parse_decimal(text) if text.isascii() else None, _shown(text), zero)
        except _C.ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _params_rate(text: str) -> float:
    """argparse type of --cpu-adam-rate: parameters a second, a finite number from 1 to 1e15."""
    value = _C.parse_decimal(text) if text.isascii() else None
    if value is None or not 1 <= value <= 1e15:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not valid; accepted: parameters a second, a number from "
                                         "1 to 1e15 (e.g. 2.5e9)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tierflow plan",
        description="Plan the activations of a transformer (keep, swap a share of the tokens, or recompute, per "
                    "block; Note [Activation planner]) and predict the device peak and step time.")
    shape = p.add_argument_group("model shape (GPT-2 style; or --model, or --profile)")
    for field in ("layers", "hidden", "heads", "seq", "batch"):
        shape.add_argument(f"--{field}", type=_shape_int(field))
    shape.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                       help="parameters' and activations' dtype (default: bf16; with --model the config's torch_dtype)")
    p.add_argument("--model", metavar="PATH",
                   help="a transformers config.json, or a directory holding one (Llama, Mistral, Qwen2, Qwen3, Gemma, "
                        "Phi-3, GPT-2, Mixtral, Qwen3-MoE); --seq defaults to its max positions (at most 4096), "
                        "--batch to 1")
    shape.add_argument("--vocab", type=_shape_int("vocab"), help="default: 50304")
    shape.add_argument("--ffn-mult", type=_shape_int("ffn_mult"), help="default: 4")
    p.add_argument("--profile", metavar="FILE", help="a recorded profile (JSON) instead of a shape")
    p.add_argument("--tflops", type=_rate(False), help="dense matmul TFLOP/s (default: measured on this machine)")
    p.add_argument("--pcie-gbps", type=_rate(False),
                   help="device<->host GB/s each way (default: measured on this machine, or the profile's)")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="device budget, e.g. 16GiB or 90%% (default: TIERFLOW_GPU_MEMORY if set, else the "
                        "device's total memory)")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="host budget for optimizer states and swapped activations (default: TIERFLOW_HOST_MEMORY)")
    p.add_argument("--nvme-memory", metavar="SIZE",
                   help="NVMe budget for swapped activations (default: TIERFLOW_NVME_MEMORY if set, else none)")
    p.add_argument("--nvme-gbps", type=_rate(True), default=0.0,
                   help="host<->NVMe GB/s each way (with --nvme-memory)")
    p.add_argument("--cpu-adam-rate", type=_params_rate, metavar="RATE",
                   help="the CPU AdamW's parameters a second with fp32 states (default: measured on this machine)")
    p.add_argument("--optimizer", choices=["none", "host", "nvme"],
                   help="where fp32 master weights and Adam states live (default: TIERFLOW_OFFLOAD_OPTIMIZER)")
    p.add_argument("--optimizer-states", metavar="{fp32,bf16,8bit}",
                   help="how the CPU AdamW (--optimizer host or nvme) keeps m and v: their bytes a parameter in the "
                        "host or NVMe budget (default: TIERFLOW_OPTIMIZER_STATES)")
    p.add_argument("--offload-params", choices=["none", "host", "nvme", "auto"],
                   help="where each block's parameters live between uses (default: TIERFLOW_OFFLOAD_PARAMS)")
    p.add_argument("--offload-gradients", metavar="{on,off}",
                   help="on: each gradient freed on the device once copied to the host (the CPU optimizer's; "
                        "default: TIERFLOW_OFFLOAD_GRADIENTS)")
    p.add_argument("--prefetch", metavar="SIZE", help="prefetch window (default: TIERFLOW_PREFETCH_BYTES)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def _one_line(message: str) -> str:
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether --json is among `argv` (as argparse reads it, abbreviations included), for an error raised before
    or while the arguments were parsed."""
    p = _Parser(add_help=False)
    p.add_argument("--json", action="store_true")
    try:
        return bool(p.parse_known_args(list(argv))[0].json)
    except (PlanError, SystemExit):
        return False


def _refuse(message: str, argv: Sequence[str]) -> int:
    """An error: one line on stderr and exit code 2; with --json also {"error": message} on stdout, so that a
    script reading the JSON reads the refusal too."""
    line = _one_line(message)
    print(f"tierflow plan: {line}", file=sys.stderr)
    if _wants_json(argv):
        print(json.dumps({"error": line}))
    return 2


def plan_command(argv: Sequence[str]) -> int:
    """Runs ``plan`` with these arguments; returns the exit code (2: one line on stderr says what is wrong; with
    --json a JSON object {"error": ...} on stdout too)."""
    try:
        args = build_parser().parse_args(argv)
        out = _plan(args, list(argv))
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except (PlanError, _C.ConfigError) as e:  # an argument, a profile or a TIERFLOW_* variable
        return _refuse(str(e), argv)
    except MemoryError as e:  # tierflow.OutOfMemoryError: the budgets are too small
        return _refuse(str(e).removeprefix("tierflow: "), argv)
    print(out)
    return 0


def _plan(args: argparse.Namespace, argv: Sequence[str] = ()) -> str:
    settings = resolve_settings()
    cuda = _C.device_is_cuda(settings.to_strings())  # as the runtime decides it (Note [Tiers from the configuration])
    model = _model(args)  # --model: the config read, and --seq, --batch and --dtype resolved
    optimizer = args.optimizer or settings.offload_optimizer
    _nvme_default(args, settings)
    _check_optimizer_tier(args, optimizer)
    _check_optimizer_flags(args, optimizer)  # before anything is measured
    if model is None:
        _shape_defaults(args)
    measured: list[str] = []
    links = _links(args, cuda, measured)
    # Blocks and what the rest of training needs on the device.
    # Parsed as the table parses TIERFLOW_OPTIMIZER_STATES, errors naming the flag.
    states = settings.optimizer_states if args.optimizer_states is None else _C.parse_setting(
        "TIERFLOW_OPTIMIZER_STATES", _text("--optimizer-states", args.optimizer_states), "--optimizer-states")
    if args.profile is not None:
        source = _profile_blocks(args, links)
    else:
        source = _estimated_blocks(args, links, cuda, optimizer, states, measured)
    if source.state is not None and optimizer != "none" and args.cpu_adam_rate is None:
        measured.append("cpu_adam_rate")  # the CPU AdamW's rate, measured here with its own kernel (C++)
    inputs = _command_inputs(args, settings, cuda, optimizer, states, source, measured)
    command = _command_budgets(inputs, source, argv)
    blocks = _C.plan_command_blocks(source.blocks, inputs)
    plan = _plan_activations(blocks, source, inputs, command, argv)
    report = _C.describe_plan(plan, blocks, inputs, command)
    if model is None:
        return report.json if args.json else "\n".join(report.lines)
    return _model_report(report, model, plan, blocks, inputs, command, args)


class _BlockSource(NamedTuple):
    """Where the plan's blocks came from: a recorded profile (--profile) or a shape's estimate."""
    blocks: Any
    links: Any
    head_bytes: int  # the saved tensors outside the blocks (the head's, or auto's measurement)
    fixed_device_bytes: int = 0  # the profile's
    outside_largest_bytes: int = 0  # the profile's largest of them (0 for a shape: the C++ estimates it)
    shape: Any = None  # the estimate's
    state: Any = None  # the estimate's training state (None: from a profile)
    flops: float | None = None  # the estimate's


def _shape_defaults(args: argparse.Namespace) -> None:
    """Without --model: a whole shape or --profile (Note [Plan report]), and the shape's defaults."""
    given = [a for a in _C.plan_shape_flags() if getattr(args, a) is not None]
    _C.check_blocks_source(args.profile is not None, given)  # a whole shape or --profile (Note [Plan report])
    args.dtype = args.dtype or "bf16"
    args.vocab = 50304 if args.vocab is None else args.vocab
    args.ffn_mult = 4 if args.ffn_mult is None else args.ffn_mult


def _links(args: argparse.Namespace, cuda: bool, measured: list[str]) -> Any:
    """--pcie-gbps's links, None for the profile's, or measured ("links" added to `measured`)."""
    if args.pcie_gbps is not None:
        return _C.links_from_pcie_gbps(args.pcie_gbps)
    if args.profile is not None:
        return None  # the profile's
    links = measure_links(cuda)
    measured.append("links")
    return links


def _profile_blocks(args: argparse.Namespace, links: Any) -> _BlockSource:
    """The blocks of --profile's file, and its links unless `links` were given."""
    try:
        with open(args.profile, encoding="utf-8") as f:
            profile = profile_from_json(f.read())
    except OSError as e:
        raise PlanError(f"--profile {args.profile!r}: {e.strerror}") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise PlanError(f"--profile {args.profile!r}: {e}") from None
    if links is None:  # the profile's: a missing or zero rate would plan every swap at inf s
        missing = [k for k in ("d2h", "h2d", "duplex") if not getattr(profile.links, k) > 0]
        if missing:
            raise PlanError(f"--profile {args.profile!r}: links has no positive {', '.join(missing)} (bytes/s); "
                            "accepted: a profile whose links d2h, h2d and duplex are positive rates (as "
                            "TIERFLOW_PROFILE writes them), or --pcie-gbps to give the link")
    # outside_saved_bytes: auto's measurement, the plan keeps or swaps them.
    return _BlockSource(blocks=profile.blocks, links=links or profile.links, head_bytes=profile.outside_saved_bytes,
                        fixed_device_bytes=profile.fixed_device_bytes,
                        outside_largest_bytes=profile.outside_largest_bytes)


def _estimated_blocks(args: argparse.Namespace, links: Any, cuda: bool, optimizer: str, states: Any,
                      measured: list[str]) -> _BlockSource:
    """The blocks, training state and head bytes estimated from the shape (--tflops given, or measured)."""
    shape = _shape(args)
    if args.tflops is not None:
        flops = args.tflops * 1e12
    else:
        flops = measure_flops(cuda)
        measured.append("tflops")
    try:
        _C.check_transformer_shape(shape)  # before building a profile per layer
        blocks = _C.estimate_transformer(shape, flops)
        state = _C.estimate_training_state(shape, optimizer, states)
        head_bytes = _C.estimate_head_device_bytes(shape)
    except ValueError as e:  # a shape the estimate refuses (ConfigError)
        raise PlanError(f"{_shape_flags(args)}: {e}") from None
    return _BlockSource(blocks=blocks, links=links, head_bytes=head_bytes, shape=shape, state=state, flops=flops)


def _command_inputs(args: argparse.Namespace, settings: Any, cuda: bool, optimizer: str, states: Any,
                    source: _BlockSource, measured: list[str]) -> Any:
    """The plan command's inputs: the budgets' and the report's (tiering/plan_report.hpp, Note [Plan report])."""
    device_name = "cuda" if cuda else "cpu (emulated device)"
    shape_out = None if source.state is None else source.shape
    inputs = _C.PlanCommandInputs(
        gpu_memory=_setting(args.gpu_memory, "--gpu-memory", settings.gpu_memory,
                            "TIERFLOW_GPU_MEMORY" in settings.given),
        host_memory=_setting(args.host_memory, "--host-memory", settings.host_memory, True),
        prefetch=_setting(args.prefetch, "--prefetch", str(settings.prefetch_bytes), True),
        nvme_memory=None if args.nvme_memory is None else _text("--nvme-memory", args.nvme_memory),
        nvme_bytes_per_second=args.nvme_gbps * _C.DECIMAL_GB, device_capacity_bytes=_C.device_capacity_bytes(cuda),
        host_capacity_bytes=_C.host_capacity_bytes(), device_name=device_name, optimizer=optimizer,
        optimizer_states=states,
        offload_params=args.offload_params or settings.offload_params,
        shape=shape_out, dtype_name=args.dtype, state=source.state, head_bytes=source.head_bytes,
        profile_path="" if args.profile is None else args.profile.encode("utf-8", "backslashreplace").decode(),
        profile_fixed_device_bytes=source.fixed_device_bytes, outside_largest_bytes=source.outside_largest_bytes,
        blocks_from=_shape_flags(args), links=source.links,
        flops_per_second=source.flops, measured=measured, links_given=args.pcie_gbps is not None)
    # Parsed as the table parses TIERFLOW_OFFLOAD_GRADIENTS, errors naming the flag (Note [Plan report], Gradients).
    inputs.offload_gradients = settings.offload_gradients if args.offload_gradients is None else _C.parse_setting(
        "TIERFLOW_OFFLOAD_GRADIENTS", _text("--offload-gradients", args.offload_gradients),
        "--offload-gradients") == "on"
    if args.cpu_adam_rate is not None:
        inputs.cpu_adam_params_per_second = args.cpu_adam_rate
    return inputs


def _command_budgets(inputs: Any, source: _BlockSource, argv: Sequence[str]) -> Any:
    """tiering's budgets for `inputs`; a budget that the estimate's optimizer states do not fit adds the settings
    that would (Note [Plan fit])."""
    try:
        return _C.plan_command_budgets(inputs)
    except ValueError as e:  # ConfigError: a budget the optimizer states do not fit, a bad size
        if source.state is None or not _budget_refusal(str(e)):
            raise
        raise PlanError(str(e) + _fit_advice(source.blocks, inputs, argv)) from None


def _plan_activations(blocks: Any, source: _BlockSource, inputs: Any, command: Any, argv: Sequence[str]) -> Any:
    """The planner's plan of `blocks` within the budgets, or a refusal naming what would fit. The fit search takes
    the estimate's blocks (source.blocks: each combination moves its own gradients); the plan takes these."""
    try:
        return _C.plan_activations(blocks, command.links, command.budgets)
    except MemoryError as e:  # tierflow.OutOfMemoryError: the budgets are too small
        advice = "" if source.state is None else _fit_advice(source.blocks, inputs, argv)
        raise PlanError(_C.plan_refusal(str(e), True, inputs, command) + advice) from None
    except ValueError as e:  # ConfigError: the profile's or the shape's bytes with the prefetch window overflow
        raise PlanError(_C.plan_refusal(str(e), False, inputs, command)) from None


def _nvme_default(args: argparse.Namespace, settings: Any) -> None:
    """--nvme-memory defaults to TIERFLOW_NVME_MEMORY when that is set (as --gpu-memory and --host-memory default
    to theirs); --nvme-gbps without an NVMe budget, which nothing would use, refused naming both."""
    env = os.environ.get("TIERFLOW_NVME_MEMORY")
    if args.nvme_memory is None and "TIERFLOW_NVME_MEMORY" in settings.given and env and env != "auto":
        args.nvme_memory = env
    if args.nvme_gbps and args.nvme_memory is None:
        raise PlanError(f"--nvme-gbps {args.nvme_gbps:g} without an NVMe budget: the rate is the NVMe tier's, and "
                        "no --nvme-memory (nor TIERFLOW_NVME_MEMORY) gives one; accepted: --nvme-gbps with "
                        "--nvme-memory SIZE, or neither")


def _check_optimizer_flags(args: argparse.Namespace, optimizer: str) -> None:
    """A flag that the optimizer's placement would silently leave unused, refused: --cpu-adam-rate with the
    optimizer on the device (torch's AdamW: no CPU step to rate). Checked before anything is measured."""
    placed = f"--optimizer {optimizer}" if args.optimizer else f"TIERFLOW_OFFLOAD_OPTIMIZER={optimizer}"
    if args.cpu_adam_rate is not None and optimizer == "none":
        raise PlanError(f"--cpu-adam-rate {args.cpu_adam_rate:g} with {placed}: the rate is the CPU AdamW's, and "
                        "with the optimizer on the device (torch's AdamW) nothing steps on the CPU; accepted: "
                        "--cpu-adam-rate with --optimizer host or nvme, or --optimizer none without --cpu-adam-rate")


def _check_optimizer_tier(args: argparse.Namespace, optimizer: str) -> None:
    """--optimizer nvme without an NVMe budget, refused before anything is measured: the states would be counted
    nowhere and the plan printed as if they fit (the fit search tries nvme only with a budget, Note [Plan fit])."""
    placed = f"--optimizer {optimizer}" if args.optimizer else f"TIERFLOW_OFFLOAD_OPTIMIZER={optimizer}"
    if optimizer == "nvme" and args.nvme_memory is None:
        raise PlanError(f"{placed} keeps the optimizer's states on NVMe, and no NVMe budget was given: the plan "
                        "cannot fit them; accepted: --nvme-memory SIZE with --nvme-gbps GBPS (the NVMe tier for "
                        "the states and swapped activations), or --optimizer host or none")


def _budget_refusal(message: str) -> bool:
    """Whether plan_command_budgets refused the budgets (the optimizer states do not fit), not an argument."""
    return "cannot hold the optimizer states" in message or "cannot hold the optimizer's pinned staging" in message


def _fit_advice(blocks: Any, inputs: Any, argv: Sequence[str]) -> str:
    """Note [Plan fit]: the settings that would make it fit, tried by the planner, with the command line."""
    search = _C.search_fitting_settings(blocks, inputs)
    return _C.fit_advice(search, "python -m tierflow plan " + shlex.join(argv))


def _model(args: argparse.Namespace) -> Any:
    """--model: its config read (Note [Model families]), refused beside a shape or a profile; --seq, --batch and
    --dtype resolved to their defaults. None without --model."""
    if args.model is None:
        return None
    shape_given = [f"--{f.replace('_', '-')}" for f in ("layers", "hidden", "heads") if getattr(args, f) is not None]
    if args.profile is not None or shape_given:
        raise PlanError(f"--model {_shown(args.model)} with {' '.join(shape_given) or '--profile'}: the blocks come "
                        "from one of them; accepted: --model PATH (with --seq, --batch, --dtype), a shape "
                        "(--layers --hidden --heads --seq --batch) or --profile FILE")
    if args.vocab is not None or args.ffn_mult is not None:
        raise PlanError("--vocab and --ffn-mult come from the config with --model; accepted: --model PATH with --seq, "
                        "--batch, --dtype")
    try:
        config = _C.load_model_config(_text("--model", args.model))
    except ValueError as e:  # ConfigError: names the file and the field
        raise PlanError(f"--model {e}") from None
    if args.seq is None:
        args.seq = _C.default_seq(config)
    if args.batch is None:
        args.batch = 1
    if args.dtype is None:
        args.dtype = config.dtype or "bf16"
    args.model_config = config
    return config


def _model_report(report: Any, model: Any, plan: Any, blocks: Any, inputs: Any, command: Any,
                  args: argparse.Namespace) -> str:
    """The plan's report with the model, the bytes per tier by kind and tokens a second (Note [Plan fit])."""
    table = _C.memory_table(plan, blocks, inputs, command)
    doc = json.loads(report.json)
    # The whole step (Note [Step prediction]: the CPU optimizer's exposed time included), else the blocks'.
    step = doc.get("step", {}).get("terms_seconds", {}).get("total") or plan.predicted_step_seconds
    tokens = args.seq * args.batch
    rate = tokens / step if step > 0 else float("inf")
    shape = inputs.shape
    params = _C.transformer_parameters(shape)
    about = (f"config: {model.family} ({model.model_type}) from {model.path}: {params / 1e9:.3g}B parameters, "
             f"{shape.layers} layers, hidden {shape.hidden}, heads {shape.heads}/{shape.kv_heads or shape.heads} kv"
             + (f", {shape.experts} experts ({shape.experts_per_token} a token)" if shape.experts else "")
             + f"; --seq {args.seq} --batch {args.batch} --dtype {args.dtype}")
    throughput = f"tokens/s: {rate:,.0f} ({tokens} tokens a step, predicted whole step {step:.4g} s)"
    if args.json:
        doc["model"] = {"family": model.family, "model_type": model.model_type, "path": model.path,
                        "parameters": params, "seq": args.seq, "batch": args.batch, "dtype": args.dtype}
        doc["bytes_per_tier"] = json.loads(table.json())
        doc["tokens_per_second"] = rate
        return json.dumps(doc)
    return "\n".join([about, *report.lines, *table.lines(), throughput])


def _setting(flag_text: str | None, flag: str, variable_text: str, variable_set: bool) -> Any:
    """A size setting for tiering's budgets: the flag's text, else the table's value of its variable (when set)."""
    if flag_text is not None:
        return _C.SettingText(text=_text(flag, flag_text), source=_C.SettingSource.flag)
    if variable_set:
        return _C.SettingText(text=variable_text, source=_C.SettingSource.variable)
    return _C.SettingText(source=_C.SettingSource.unset)


def _shape_flags(args: argparse.Namespace) -> str:
    """The arguments that made the blocks: the shape's flags, or --profile."""
    if args.profile is not None:
        return f"--profile {args.profile!r}"
    if args.model is not None:
        return f"--model {args.model!r} --seq {args.seq} --batch {args.batch} --dtype {args.dtype}"
    fields = ("layers", "hidden", "heads", "seq", "batch", "vocab", "ffn_mult")
    return " ".join(f"--{f.replace('_', '-')} {getattr(args, f)}" for f in fields) + f" --dtype {args.dtype}"


def _shape(args: argparse.Namespace) -> Any:
    if args.model is not None:
        shape = args.model_config.shape
        shape.seq, shape.batch, shape.dtype_bytes = args.seq, args.batch, DTYPE_BYTES[args.dtype]
        return shape
    return _C.TransformerShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                               batch=args.batch, dtype_bytes=DTYPE_BYTES[args.dtype], vocab=args.vocab,
                               ffn_mult=args.ffn_mult)
