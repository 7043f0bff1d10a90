"""``python -m tierflow plan``: what fits, and how fast, from a transformer shape or a recorded profile.

The planner itself is C++ (tiering/planner.hpp, Note [Activation planner]); this
module gathers its inputs (an estimated or recorded block profile, link
bandwidths, budgets), runs it and prints the plan.

Profile files
-------------
A recorded profile is JSON; tierflow's profiler writes it and ``--profile``
reads it (``profile_to_json`` / ``profile_from_json``)::

    {"format": "tierflow-profile", "version": 1,
     "blocks": [{"forward_seconds": f, "backward_seconds": f, "input_bytes": n, "whole_bytes": n,
                 "split_bytes": n, "split_recompute_seconds": f, "cheap_bytes": n,
                 "cheap_recompute_seconds": f, "splittable": b, "transient_bytes": n}, ...],
     "links": {"d2h": f, "h2d": f, "duplex": f, "nvme_write": f, "nvme_read": f},
     "fixed_device_bytes": n}

``blocks`` are in forward order, one per repeated block, fields as in
``tierflow._C.BlockProfile`` (a missing field takes its default, an unknown one
is an error); ``links`` are bytes per second (0: absent); ``fixed_device_bytes``
is what the rest of training needs on the device (parameters, gradients,
optimizer states, workspace, the activations outside the blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from . import _C

PROFILE_FORMAT = "tierflow-profile"
PROFILE_VERSION = 1
BLOCK_FIELDS = ("forward_seconds", "backward_seconds", "input_bytes", "whole_bytes", "split_bytes",
                "split_recompute_seconds", "cheap_bytes", "cheap_recompute_seconds", "splittable",
                "transient_bytes")
LINK_FIELDS = ("d2h", "h2d", "duplex", "nvme_write", "nvme_read")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GB = 1e9  # link speeds are decimal, like the vendors'


@dataclass
class Profile:
    """A recorded profile: the blocks, the links and the device bytes the rest of training needs."""

    blocks: list  # of _C.BlockProfile
    links: Any  # _C.Links
    fixed_device_bytes: int


def profile_to_json(blocks: Sequence[Any], links: Any, fixed_device_bytes: int) -> str:
    """The profile file's text (see the module's doc). `blocks` are BlockProfiles or dicts of their fields."""
    def block_dict(b: Any) -> dict:
        if isinstance(b, dict):
            return {k: b[k] for k in BLOCK_FIELDS if k in b}
        return {k: getattr(b, k) for k in BLOCK_FIELDS}
    link = links if isinstance(links, dict) else {k: getattr(links, k) for k in LINK_FIELDS}
    return json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                       "blocks": [block_dict(b) for b in blocks], "links": link,
                       "fixed_device_bytes": int(fixed_device_bytes)}, indent=1)


def profile_from_json(text: str) -> Profile:
    """Parses a profile file's text; raises ValueError saying what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"profile: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("blocks"), list) or not data["blocks"]:
        raise ValueError('profile: expected an object with a non-empty "blocks" list')
    if data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT or data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        raise ValueError(f"profile: format {data.get('format')!r} version {data.get('version')!r} is not "
                         f"{PROFILE_FORMAT!r} version {PROFILE_VERSION}")
    blocks = []
    for i, b in enumerate(data["blocks"]):
        unknown = set(b) - set(BLOCK_FIELDS)
        if unknown:
            raise ValueError(f"profile: block {i} has unknown fields {sorted(unknown)}; known: {list(BLOCK_FIELDS)}")
        blocks.append(_C.BlockProfile(**b))
    links = data.get("links", {})
    unknown = set(links) - set(LINK_FIELDS)
    if unknown:
        raise ValueError(f"profile: links has unknown fields {sorted(unknown)}; known: {list(LINK_FIELDS)}")
    return Profile(blocks, _C.Links(**links), int(data.get("fixed_device_bytes", 0)))


# ---- measurements ----------------------------------------------------------------------------

def _use_cuda() -> bool:
    choice = _C.resolve_config({})["TIERFLOW_DEVICE"]
    return choice == "cuda" or (choice == "auto" and _C.cuda_available())


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
    """Device<->host bandwidths: pinned copies each way and both at once on a GPU; a host memcpy emulated."""
    import torch
    if not cuda:
        n = 64 << 20
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        bw = 4 * n / (time.perf_counter() - t0)
        return _C.Links(d2h=bw, h2d=bw, duplex=bw)
    n = 256 << 20
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_in = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    dev_out = torch.ones(n, dtype=torch.uint8, device="cuda")
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(d2h: bool, h2d: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            if d2h:
                with torch.cuda.stream(s1):
                    host_out.copy_(dev_out, non_blocking=True)
            if h2d:
                with torch.cuda.stream(s2):
                    dev_in.copy_(host_in, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(True, True)  # warm-up
    d2h = 3 * n / timed(True, False)
    h2d = 3 * n / timed(False, True)
    duplex = 2 * 3 * n / timed(True, True)
    return _C.Links(d2h=d2h, h2d=h2d, duplex=duplex)


# ---- the command -----------------------------------------------------------------------------

class PlanError(Exception):
    """A user error: printed and exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tierflow plan",
        description="Plan the activations of a transformer (keep, swap a share of the tokens, or recompute, per "
                    "block; Note [Activation planner]) and predict the device peak and step time.")
    shape = p.add_argument_group("model shape (GPT-2 style; or --profile)")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--hidden", type=int)
    shape.add_argument("--heads", type=int)
    shape.add_argument("--seq", type=int)
    shape.add_argument("--batch", type=int)
    shape.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    shape.add_argument("--vocab", type=int, default=50304)
    shape.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument("--profile", metavar="FILE", help="a recorded profile (JSON) instead of a shape")
    p.add_argument("--tflops", type=float, help="dense matmul TFLOP/s (default: measured on this machine)")
    p.add_argument("--pcie-gbps", type=float,
                   help="device<->host GB/s each way (default: measured on this machine, or the profile's)")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="device budget, e.g. 16GiB or 90%% (default: TIERFLOW_GPU_MEMORY if set, else the "
                        "device's total memory)")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="host budget for optimizer states and swapped activations (default: TIERFLOW_HOST_MEMORY)")
    p.add_argument("--nvme-memory", metavar="SIZE", help="NVMe budget for swapped activations (default: none)")
    p.add_argument("--nvme-gbps", type=float, default=0.0, help="host<->NVMe GB/s each way (with --nvme-memory)")
    p.add_argument("--optimizer", choices=["none", "host", "nvme"],
                   help="where fp32 master weights and Adam states live (default: TIERFLOW_OFFLOAD_OPTIMIZER)")
    p.add_argument("--prefetch", metavar="SIZE", help="prefetch window (default: TIERFLOW_PREFETCH_BYTES)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def _size(text: str, capacity: int, flag: str) -> int:
    try:
        return int(_C.parse_budget(text, capacity))
    except (ValueError, RuntimeError) as e:
        raise PlanError(f"{flag} {text}: {e}") from None


def plan_command(argv: Sequence[str]) -> int:
    """Runs ``plan`` with these arguments; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = _plan(args)
    except PlanError as e:
        print(f"tierflow plan: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # tierflow.OutOfMemoryError: the budgets are too small
        print(f"tierflow plan: {str(e).removeprefix('tierflow: ')}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _plan(args: argparse.Namespace) -> str:
    config = _C.resolve_config({})
    cuda = _use_cuda()
    shape_args = ("layers", "hidden", "heads", "seq", "batch")
    given = [a for a in shape_args if getattr(args, a) is not None]
    if args.profile and given:
        raise PlanError(f"--profile and a shape (--{', --'.join(given)}) exclude each other")
    if not args.profile and len(given) < len(shape_args):
        missing = [a for a in shape_args if getattr(args, a) is None]
        raise PlanError(f"give a shape (missing --{', --'.join(missing)}) or --profile FILE")
    if args.tflops is not None and args.tflops <= 0:
        raise PlanError(f"--tflops {args.tflops}: must be positive")
    if args.pcie_gbps is not None and args.pcie_gbps <= 0:
        raise PlanError(f"--pcie-gbps {args.pcie_gbps}: must be positive")
    measured: list[str] = []
    device_name = "cuda" if cuda else "cpu (emulated device)"

    # Links.
    if args.pcie_gbps is not None:
        bw = args.pcie_gbps * GB
        links = _C.Links(d2h=bw, h2d=bw, duplex=2 * bw)
    elif args.profile:
        links = None  # the profile's
    else:
        links = measure_links(cuda)
        measured.append("links")

    # Blocks and what the rest of training needs on the device.
    state = None
    head_bytes = 0
    optimizer = args.optimizer or config["TIERFLOW_OFFLOAD_OPTIMIZER"]
    if args.profile:
        try:
            with open(args.profile) as f:
                profile = profile_from_json(f.read())
        except OSError as e:
            raise PlanError(f"--profile {args.profile}: {e.strerror}") from None
        except (ValueError, TypeError) as e:
            raise PlanError(f"--profile {args.profile}: {e}") from None
        blocks = profile.blocks
        links = links or profile.links
        fixed = profile.fixed_device_bytes
        flops = None
    else:
        shape = _shape(args)
        if args.tflops is not None:
            flops = args.tflops * 1e12
        else:
            flops = measure_flops(cuda)
            measured.append("tflops")
        try:
            blocks = _C.estimate_transformer(shape, flops)
            state = _C.estimate_training_state(shape, optimizer)
            head_bytes = _C.estimate_head_device_bytes(shape)
        except ValueError as e:  # a shape the estimate refuses (ConfigError)
            raise PlanError(str(e)) from None
        fixed = state.device + head_bytes

    # Budgets.
    device_capacity = _C.device_capacity_bytes(cuda)
    if args.gpu_memory:
        device_bytes, device_from = _size(args.gpu_memory, device_capacity, "--gpu-memory"), "--gpu-memory"
    elif "TIERFLOW_GPU_MEMORY" in os.environ:
        device_bytes = _size(os.environ["TIERFLOW_GPU_MEMORY"], device_capacity, "TIERFLOW_GPU_MEMORY")
        device_from = "TIERFLOW_GPU_MEMORY"
    else:
        device_bytes, device_from = device_capacity, f"the {device_name} device's total memory"
    host_capacity = _C.host_capacity_bytes()
    host_text = args.host_memory or config["TIERFLOW_HOST_MEMORY"]
    host_total = _size(host_text, host_capacity, "--host-memory" if args.host_memory else "TIERFLOW_HOST_MEMORY")
    optimizer_host = state.host if state else 0
    if optimizer_host > host_total:
        where = "--host-memory" if args.host_memory else "TIERFLOW_HOST_MEMORY"
        raise PlanError(f"the host budget {_C.format_bytes(host_total)} ({where}={host_text}, of "
                        f"{_C.format_bytes(host_capacity)} RAM here) cannot hold the optimizer "
                        f"states' {_C.format_bytes(optimizer_host)}: it needs {optimizer_host} bytes and more for "
                        f"activations; pass --host-memory, or --optimizer nvme")
    nvme_bytes = _size(args.nvme_memory, 0, "--nvme-memory") if args.nvme_memory else 0
    if nvme_bytes and args.nvme_gbps <= 0:
        raise PlanError("--nvme-memory needs --nvme-gbps")
    if nvme_bytes:
        links.nvme_write = links.nvme_read = args.nvme_gbps * GB
    prefetch = _size(args.prefetch or config["TIERFLOW_PREFETCH_BYTES"], 0, "--prefetch")
    budgets = _C.Budgets(device_bytes=device_bytes, fixed_device_bytes=fixed, host_bytes=host_total - optimizer_host,
                         nvme_bytes=nvme_bytes, prefetch_bytes=prefetch)

    plan = _C.plan_activations(blocks, links, budgets)  # OutOfMemoryError: exit 2

    if args.json:
        return json.dumps(_plan_json(plan, budgets, links, flops, measured, state, head_bytes, optimizer, args))
    return _plan_text(plan, budgets, links, flops, measured, state, head_bytes, optimizer, args, device_from,
                      device_name)


def _plan_json(plan, budgets, links, flops, measured, state, head_bytes, optimizer, args) -> dict:
    layers = [{"mode": b.mode.name, "alpha": b.alpha, "keep": b.keep, "swap": b.swap, "recompute": b.recompute,
               "swap_tier": b.tier.name, "swap_bytes": b.swap_bytes, "forward_seconds": b.forward_seconds,
               "backward_seconds": b.backward_seconds} for b in plan.blocks]
    out: dict[str, Any] = {
        "layers": layers,
        "predicted": {"gpu_peak_bytes": plan.predicted_device_peak_bytes, "step_seconds": plan.predicted_step_seconds,
                      "keep_all_step_seconds": plan.keep_all_step_seconds, "host_bytes": plan.host_bytes,
                      "nvme_bytes": plan.nvme_bytes, "proven_optimal": plan.proven_optimal},
        "budgets": {"gpu_bytes": budgets.device_bytes, "fixed_gpu_bytes": budgets.fixed_device_bytes,
                    "host_bytes_for_activations": budgets.host_bytes, "nvme_bytes": budgets.nvme_bytes,
                    "prefetch_bytes": budgets.prefetch_bytes},
        "links": {k: getattr(links, k) for k in LINK_FIELDS},
        "tflops": flops / 1e12 if flops else None,
        "measured": measured,
        "summary": plan.summary(),
    }
    if state is not None:
        out["state"] = {"optimizer": optimizer, "gpu_bytes": state.device, "host_bytes": state.host,
                        "nvme_bytes": state.nvme, "outside_blocks_gpu_bytes": head_bytes}
    return out


def _plan_text(plan, budgets, links, flops, measured, state, head_bytes, optimizer, args, device_from,
               device_name) -> str:
    fb = _C.format_bytes
    lines = []
    if state is not None:
        lines.append(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
                     f"batch {args.batch}, {args.dtype}, vocab {args.vocab} "
                     f"({_C.transformer_parameters(_shape(args)) / 1e9:.3g}B parameters)")
    else:
        lines.append(f"profile: {args.profile} ({len(plan.blocks)} blocks)")
    where = f" (measured on {device_name})"
    if flops:
        lines.append(f"compute: {flops / 1e12:.3g} TFLOP/s" + (where if "tflops" in measured else " (given)"))
    lines.append(f"links: {links.d2h / GB:.3g} GB/s device->host, {links.h2d / GB:.3g} GB/s host->device"
                 + (where if "links" in measured else " (given)" if args.pcie_gbps else " (from the profile)")
                 + (f"; NVMe {links.nvme_write / GB:.1f} GB/s write, {links.nvme_read / GB:.1f} GB/s read"
                    if budgets.nvme_bytes else ""))
    host_from = "--host-memory" if args.host_memory else "TIERFLOW_HOST_MEMORY"
    optimizer_host = state.host if state is not None else 0
    lines.append(f"budgets: device {fb(budgets.device_bytes)} ({device_from}); host {fb(budgets.host_bytes)} for "
                 f"activations ({fb(budgets.host_bytes + optimizer_host)} from {host_from}, less "
                 f"{fb(optimizer_host)} of optimizer states); NVMe "
                 f"{fb(budgets.nvme_bytes) if budgets.nvme_bytes else 'none'}; prefetch window "
                 f"{fb(budgets.prefetch_bytes)}")
    if state is not None:
        lines.append(f"parameters and optimizer (--optimizer {optimizer}): device {fb(state.device)}, host "
                     f"{fb(state.host)}, NVMe {fb(state.nvme)}; activations outside the blocks (final norm, head, "
                     f"fp32 loss): device {fb(head_bytes)}")
    else:
        lines.append(f"the rest of training on the device (from the profile): {fb(budgets.fixed_device_bytes)}")
    lines.append("plan (forward order):")
    lines.extend("  " + plan.block_line(i) for i in range(len(plan.blocks)))
    lines.append(plan.summary())
    lines.append(f"predicted: device peak {fb(plan.predicted_device_peak_bytes)} of {fb(budgets.device_bytes)}, "
                 f"blocks' forward + backward {plan.predicted_step_seconds:.4f} s per step "
                 f"(keeping everything: {plan.keep_all_step_seconds:.4f} s)")
    return "\n".join(lines)


def _shape(args: argparse.Namespace) -> Any:
    return _C.TransformerShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                               batch=args.batch, dtype_bytes=DTYPE_BYTES[args.dtype], vocab=args.vocab,
                               ffn_mult=args.ffn_mult)
