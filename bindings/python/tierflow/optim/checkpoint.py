"""tierflow's CPU AdamW to and from a state dict (CPUAdamW.state_dict / load_state_dict): torch's layout, the
fp32 master only where the parameter is not fp32, NVMe states read back into CPU tensors or marked lost (Note
[NVMe optimizer faults]), FSDP2's shards as DTensors (Note [Distributed training]), a partitioned optimizer's
share recorded and checked (Note [Partitioned optimizer]).

Note [Optimizer states in checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A state dict carries the moments in the optimizer's own format (Note [Optimizer state formats]): fp32 and bf16
moments as they are (float32 / bfloat16 tensors shaped like the parameter); 8-bit ones as ``exp_avg_codes`` = the
uint8 codes shaped like the parameter (a view of the moment's one buffer, no copy) plus ``exp_avg_absmax`` = its
fp32 scales [quant_blocks] (a copy: torch.save refuses a float32 and a uint8 view of one storage), the same for
``exp_avg_sq``. No ``exp_avg`` then: torch.optim.AdamW would load codes under that name as moments, cast to
floats without a word (a review found it stepping on them); without it, its step stops at the missing key. To
hand an 8-bit run to torch, load its state dict into a CPUAdamW with fp32 states and save that. Under FSDP2 the 8-bit moments go out decoded to fp32
(DTensors like the other states): their scales are per block of this rank's shard and could not be resharded.
load_state_dict takes any format (torch.optim.AdamW's fp32 included) and converts it into this optimizer's,
through fp32 (decode, then encode), with one log line naming the conversion; decoding then encoding gives back
the same codes and scales, so a resume through fp32 (FSDP2's, or a format change and back) is bit for bit."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import _C
from .copies import local_shard, moment_format, moment_views, packed_moment
from .nvme_states import LOST_STATE
from .partition import LAYOUT_KEY

_MOMENTS = ("exp_avg", "exp_avg_sq")
# An 8-bit moment in a state dict: its codes and its scales, under names of their own (not "exp_avg"): a
# torch optimizer loading it must not take the codes for moments (torch casts them to floats without a word).
_CODES = {name: name + "_codes" for name in _MOMENTS}
_ABSMAX = {name: name + "_absmax" for name in _MOMENTS}
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master", *_CODES.values(), *_ABSMAX.values())


def state_dict_of(opt: Any, sd: dict) -> dict:
    """``sd`` (torch's state_dict of ``opt``, after its worker settled) made a CPUAdamW's."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if opt.states_on_nvme:
        sd["state"] = {k: opt.exportable_state(params[k]) for k in sd["state"]}
    index = {i: p for i, p in enumerate(params)}
    state = {}
    for k, s in sd["state"].items():
        p = index.get(k)
        if p is not None and p.dtype == torch.float32 and "master" in s:
            s = {n: v for n, v in s.items() if n != "master"}
        if p is not None:
            s = exported_moments(s, local_shard(p), decode=opt.sharded)
        state[k] = s
    sd["state"] = state
    if opt.sharded:
        sd["state"] = {k: as_dtensors(s, params[k]) for k, s in state.items()}
    if opt.partition is not None:  # Note [Partitioned optimizer]: whose share this is
        sd[LAYOUT_KEY] = opt.partition.layout
    return sd


def exported_moments(s: dict, shard: torch.Tensor, decode: bool) -> dict:
    """Note [Optimizer states in checkpoints]: ``s`` (a new dict where it changes; the live state stays) with
    8-bit moments as codes shaped like ``shard`` and their scales (views), or decoded to fp32 when ``decode``
    (FSDP2: shaped like the shard, so they go out as DTensors)."""
    m, v = s.get("exp_avg"), s.get("exp_avg_sq")
    if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor) or moment_format(m) != "8bit" or \
            m.dim() != 1 or m.numel() != _C.moment_bytes("8bit", shard.numel()):
        return s
    out = dict(s)
    if decode:
        dm, dv = _C.decode_moments(m, v, shard.numel())
        out["exp_avg"], out["exp_avg_sq"] = dm.view(shard.shape), dv.view(shard.shape)
        return out
    for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
        codes, absmax = moment_views(t, shard)
        # torch.save refuses two dtypes over one storage: the scales (4 bytes a 256 elements) are a copy.
        del out[name]
        out[_CODES[name]], out[_ABSMAX[name]] = codes, absmax.clone()
    return out


def as_dtensors(s: dict, p: torch.Tensor) -> dict:
    """FSDP2: a new dict of p's state (the live one stays as it is) whose tensors of this rank's shard go out
    as DTensors like p (torch's AdamW keeps DTensor states under FSDP2), so that torch.distributed.checkpoint
    saves every rank's shard and loads each back where it belongs (Note [Distributed training]). The local
    tensor stays where it is, in host memory: DTensor.from_local would copy it to the mesh's device (the
    GPU), the memory offload frees; FSDP2's CPUOffloadPolicy builds its DTensors the same way."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = local_shard(p).shape
    out = {}
    for name, v in s.items():
        if isinstance(v, torch.Tensor) and v.shape == shape:
            spec = DTensorSpec(p.device_mesh, p.placements, TensorMeta(p.shape, p.stride(), v.dtype))
            v = DTensor(v, spec, requires_grad=False)
        out[name] = v
    return out


def check_loadable(opt: Any, state_dict: dict) -> Any:
    """Refuses, before anything changes, a state dict with states marked lost (Note [NVMe optimizer faults])
    and one of another partition's share (Note [Partitioned optimizer]); returns its share's layout."""
    for i, group in enumerate(state_dict.get("param_groups", [])):  # amsgrad keeps fp32 moments
        opt.check_amsgrad(group, i)
    lost = [k for k, s in state_dict.get("state", {}).items() if isinstance(s, dict) and LOST_STATE in s]
    if lost:
        params = [p for g in opt.param_groups for p in g["params"]]
        raise _C.TierflowError(_C.lost_states_refusal(
            [opt.describe(params[k]) if isinstance(k, int) and k < len(params)
             else repr(k) for k in lost]))
    layout = state_dict.get(LAYOUT_KEY)
    if opt.partition is not None:
        opt.partition.check_loaded(states_by_param(state_dict, opt.param_groups), layout)
    elif layout is not None and not opt.partition_pending():
        raise _C.TierflowError(_C.partition_layout_refusal(layout, None))
    return layout


def master_from(opt: Any, saved: Optional[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    # A saved master is used only where it is consistent with the parameter:
    # a checkpoint that went through torch.optim may carry a stale one.
    value = opt.weight_source(p)
    if saved is None or p.dtype == torch.float32:
        return value
    if saved.shape == p.shape and torch.equal(saved.to(p.dtype), value.to(saved.device)):
        return saved
    return value


def load(opt: Any, state_dict: dict, torch_load: Callable[[dict], None]) -> None:
    """CPUAdamW.load_state_dict: refused before anything changes (check_loadable); else torch's load
    (``torch_load``), the shared param groups kept, and each parameter's state restored in fp32 on its tier."""
    layout = check_loadable(opt, state_dict)
    converted: set = set()  # the formats of loaded moments that were converted into the optimizer's
    opt.settle_before_load()  # the next step() still takes this backward's gradients; early steps read the state
    # Where every parameter steps in step() (no stream) or FSDP2's shards (whose next step is step()'s: a
    # stale master turns the stream off for it), a saved master is taken as it is and the next step checks it
    # against its parameter (reconcile_master): the model may be loaded after the optimizer, as
    # torch.distributed.checkpoint's set_state_dict does.
    reconcile = (opt.streaming is None or opt.sharded) and not opt.states_on_nvme
    # torch casts state to the parameter's dtype; keep the fp32 originals (FSDP2: this rank's shards).
    originals = {k: {n: local_shard(v) for n, v in s.items() if n in _STATE_KEYS}
                 for k, s in state_dict["state"].items()}
    stores = opt.tier_stores()  # torch replaces opt.state: the NVMe stores are written again
    groups, dicts = opt.param_groups, list(opt.param_groups)
    torch_load(state_dict)
    # torch puts fresh group dicts in a fresh list; keep the shared ones (Note [Shared param groups]).
    for shared, loaded in zip(dicts, opt.param_groups):
        if shared is not loaded:
            shared.clear()
            shared.update(loaded)
    groups[:] = dicts
    opt.param_groups = groups
    if opt.partition is not None:  # a whole state dict: the other ranks keep theirs
        opt.partition.drop_others(opt.state)
    else:  # checked when the partition is made (DDP seen after this load)
        opt.keep_loaded_layout(layout)
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        for p, key in zip(group["params"], saved["params"]):
            if p in opt.state and key in originals:
                restore_state(opt, p, group, originals[key], reconcile, stores.get(p), converted)
    opt.master_stale = reconcile
    if converted:  # Note [Optimizer states in checkpoints]: once a load, naming the formats
        target = opt.state_format
        lossy = any(_NARROWER[target] < _NARROWER[f] for f in converted)
        _C.log("warn" if lossy else "info",
               f"tierflow: the optimizer states loaded (a state dict, or the optimizer tierflow.wrap replaced) are "
               f"{' and '.join(sorted(converted))}; converted to {target} (TIERFLOW_OPTIMIZER_STATES)")


_NARROWER = {"fp32": 2, "bf16": 1, "8bit": 0}  # bits kept, in order: a conversion to a lower one loses some


def loaded_moments(original: dict, shard: torch.Tensor) -> Optional[tuple]:
    """A loaded state's moments as (format, m, v): fp32 (any float dtype but bfloat16, as float32), bf16, or
    8bit (the one buffer, from ``*_codes`` and ``*_absmax``, or the buffer itself); None without both."""
    if any(_CODES[n] in original for n in _MOMENTS):
        if not all(_CODES[n] in original and _ABSMAX[n] in original for n in _MOMENTS):
            raise _C.TierflowError("tierflow CPUAdamW.load_state_dict: an 8-bit state needs exp_avg_codes, "
                                   "exp_avg_absmax, exp_avg_sq_codes and exp_avg_sq_absmax, as CPUAdamW.state_dict "
                                   f"writes them; this one has {sorted(k for k in original if k != 'step')}")
        original = dict(original, exp_avg=original["exp_avg_codes"], exp_avg_sq=original["exp_avg_sq_codes"])
    m, v = original.get("exp_avg"), original.get("exp_avg_sq")
    if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor):
        return None
    m, v = m.detach().cpu(), v.detach().cpu()
    if m.dtype != v.dtype:
        raise _C.TierflowError(f"tierflow CPUAdamW.load_state_dict: exp_avg is {m.dtype} and exp_avg_sq "
                               f"{v.dtype}; accepted: both of one format (float32, bfloat16, or uint8 codes)")
    fmt = moment_format(m)
    if fmt == "8bit":
        n = shard.numel()
        bufs = []
        for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
            absmax = original.get(_ABSMAX[name])
            if absmax is not None:
                if t.numel() != n:
                    raise _C.TierflowError(f"tierflow CPUAdamW.load_state_dict: 8-bit {name} has {t.numel()} codes "
                                           f"for a parameter of {n} elements")
                bufs.append(packed_moment(t, absmax.detach().cpu()))
            elif t.dim() == 1 and t.numel() == _C.moment_bytes("8bit", n):
                bufs.append(t.contiguous())
            else:
                raise _C.TierflowError(f"tierflow CPUAdamW.load_state_dict: 8-bit {name} (uint8) without "
                                       f"{_ABSMAX[name]}; accepted: codes shaped like the parameter with their "
                                       "scales, as CPUAdamW.state_dict writes them")
        return fmt, bufs[0], bufs[1]
    if fmt == "bf16":
        return fmt, m.contiguous(), v.contiguous()
    if not m.is_floating_point():
        raise _C.TierflowError(f"tierflow CPUAdamW.load_state_dict: exp_avg of dtype {m.dtype}; accepted: float32, "
                               "bfloat16 (bf16), uint8 with exp_avg_absmax (8bit)")
    return "fp32", m.to(torch.float32).contiguous(), v.to(torch.float32).contiguous()


def restore_moments(opt: Any, shard: torch.Tensor, state: dict, original: dict, converted: set) -> None:
    """state's exp_avg and exp_avg_sq from ``original`` (the loaded state), in the optimizer's format: as they
    are when the formats agree, else decoded to fp32 and encoded (``converted`` gets the loaded format)."""
    loaded = loaded_moments(original, shard)
    target = opt.state_format
    if loaded is None:  # a partial state: each moment there as fp32, the other zero (both in the target format)
        ms = {n: original[n].detach().to("cpu", torch.float32) if isinstance(original.get(n), torch.Tensor)
              else torch.zeros(shard.shape) for n in _MOMENTS}
        if all(not isinstance(original.get(n), torch.Tensor) for n in _MOMENTS):
            return
        loaded = ("fp32", ms["exp_avg"].contiguous(), ms["exp_avg_sq"].contiguous())
    fmt, m, v = loaded
    fresh_m, fresh_v = opt.host_moment(shard), opt.host_moment(shard)
    if fmt == target:
        fresh_m.view(-1).copy_(m.reshape(-1))
        fresh_v.view(-1).copy_(v.reshape(-1))
    else:
        converted.add(fmt)
        if fmt != "fp32":
            m, v = _C.decode_moments(m, v, shard.numel())
        if target == "fp32":
            fresh_m.view(-1).copy_(m.reshape(-1))
            fresh_v.view(-1).copy_(v.reshape(-1))
        else:
            _C.encode_moments(target, m.reshape(shard.shape), v.reshape(shard.shape), fresh_m, fresh_v)
    state["exp_avg"], state["exp_avg_sq"] = fresh_m, fresh_v


def restore_state(opt: Any, p: torch.Tensor, group: dict, original: dict, reconcile: bool, store: Any,
                  converted: Optional[set] = None) -> None:
    """After torch's load: p's state in fp32 host tensors of its own (``original``: the loaded fp32 states,
    which torch cast to p's dtype), a master (the loaded one where it is consistent, or taken as it is when
    ``reconcile``: the next step checks it against p), and back to its tier (``store``: the NVMe store it had
    before the load, written in place)."""
    state = opt.state[p]
    shard = local_shard(p)  # FSDP2: this rank's shard
    for name in (*_CODES.values(), *_ABSMAX.values()):  # torch's load put them (cast) in the state
        state.pop(name, None)
    restore_moments(opt, shard, state, original, set() if converted is None else converted)
    if "max_exp_avg_sq" in original:
        fresh = opt.host_tensor(shard, False)
        fresh.copy_(original["max_exp_avg_sq"])
        state["max_exp_avg_sq"] = fresh
    if group["amsgrad"] and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = opt.host_tensor(shard, True)
    master = opt.host_tensor(shard, False)
    saved = original.get("master")
    if reconcile and saved is not None and saved.shape == shard.shape:
        master.copy_(saved)  # the next step keeps it where the parameter is its rounding
    else:
        master.copy_(master_from(opt, saved, shard))
    state["master"] = master
    state["step"] = torch.tensor(float(state.get("step", 0.0)), dtype=torch.float32)
    opt.place_state(p, group, store)


def states_by_param(state_dict: dict, groups: list) -> dict:
    """The parameters of ``groups`` that ``state_dict`` holds a state for, as {param: state} (torch maps saved
    indices to parameters by their order across the groups)."""
    saved = [k for g in state_dict.get("param_groups", []) for k in g["params"]]
    params = [p for g in groups for p in g["params"]]
    states = state_dict.get("state", {})
    return {p: states[k] for k, p in zip(saved, params) if k in states}
