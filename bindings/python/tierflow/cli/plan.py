"""``python -m tierflow plan``: what fits, and how fast, from a transformer shape, a transformers config.json
(``--model PATH``, Note [Model families] in tiering/model_config.hpp) or a recorded profile.

With ``--model``, --seq defaults to the config's max_position_embeddings (GPT-2: n_positions) capped at 4096,
--batch to 1 and --dtype to the config's torch_dtype (else bf16); the output adds the bytes per tier by kind and
tokens a second, and a plan that does not fit names the settings that would (tried by the planner, Note [Plan fit]).

The command past its argument parser is C++ (tiering/plan_cli.hpp): the arguments' refusals, --model, the
blocks (estimated, or a recorded profile: tiering/profile_file.hpp, Note [Profile file]), the budgets, the plan
(tiering/planner.hpp, Note [Activation planner]) and its report (tiering/plan_report.hpp, Note [Plan report]). This
module parses argv, reads the profile file and measures what that asks for through torch (links, matmul rate).

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
from typing import Any, Callable, Sequence

from .. import _native as _C  # tierflow._core's names (torch-free); any other loads torch, then tierflow._C
from .._config import resolve_settings


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
    """argparse type of --cpu-adam-rate: parameters a second (tiering::check_params_rate), no inf or nan."""
    try:
        return _C.check_params_rate(_C.parse_decimal(text) if text.isascii() else None, _shown(text))
    except _C.ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tierflow plan",
        description="Plan the activations of a transformer (keep, swap a share of the tokens, or recompute, per "
                    "block; Note [Activation planner]) and predict the device peak and step time.")
    shape = p.add_argument_group("model shape (GPT-2 style; or --model, or --profile)")
    for field in ("layers", "hidden", "heads", "seq", "batch"):
        shape.add_argument(f"--{field}", type=_shape_int(field))
    shape.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
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
    """The command past its parser (tiering/plan_cli.hpp): the arguments checked before anything is measured, then
    what tiering asks for measured here (torch) and the plan run."""
    settings = resolve_settings()
    cuda = _C.device_is_cuda(settings.to_strings())  # as the runtime decides it (Note [Tiers from the configuration])
    command = _C.PlanCommand(_arguments(args), settings, _nvme_variable())
    links = _links(command, cuda)
    flops = measure_flops(cuda) if command.needs_flops else None
    return command.run(cuda=cuda, device_capacity_bytes=_C.device_capacity_bytes(cuda),
                       host_capacity_bytes=_C.host_capacity_bytes(), links=links, flops_per_second=flops,
                       profile_text=None if args.profile is None else _read_profile(args.profile),
                       command_line="python -m tierflow plan " + shlex.join(argv))


def _arguments(args: argparse.Namespace) -> Any:
    """argparse's namespace as tiering's PlanArguments: texts that go to C++ checked to be UTF-8, and --model's and
    --profile's paths as the refusals quote them (Python's repr)."""
    fields = {k: v for k, v in vars(args).items() if v is not None}
    for flag in ("model", "gpu_memory", "host_memory", "nvme_memory", "prefetch", "optimizer_states",
                 "offload_gradients"):
        if flag in fields:
            fields[flag] = _text(f"--{flag.replace('_', '-')}", fields[flag])
    if args.model is not None:
        fields.update(model_repr=repr(args.model), model_shown=_shown(args.model))
    if args.profile is not None:
        fields.update(profile=args.profile.encode("utf-8", "backslashreplace").decode(), profile_repr=repr(args.profile))
    return _C.PlanArguments(**fields)


def _nvme_variable() -> str | None:
    """TIERFLOW_NVME_MEMORY's text, --nvme-memory's default when set (PlanCommand)."""
    env = os.environ.get("TIERFLOW_NVME_MEMORY")
    return None if env is None else _text("--nvme-memory", env)


def _links(command: Any, cuda: bool) -> Any:
    """The links measured on this machine when the command needs them (neither --pcie-gbps nor --profile)."""
    return measure_links(cuda) if command.needs_links else None


def _read_profile(path: str) -> str:
    """--profile's text; a file that cannot be read as UTF-8 refused naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise PlanError(f"--profile {path!r}: {e.strerror}") from None
    except ValueError as e:  # UnicodeDecodeError
        raise PlanError(f"--profile {path!r}: {e}") from None
