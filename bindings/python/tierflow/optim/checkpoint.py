"""tierflow's CPU AdamW to and from a state dict (CPUAdamW.state_dict / load_state_dict): torch's layout, the
fp32 master only where the parameter is not fp32, NVMe states read back into CPU tensors or marked lost (Note
[NVMe optimizer faults]), FSDP2's shards as DTensors (Note [Distributed training]), a partitioned optimizer's
share recorded and checked (Note [Partitioned optimizer])."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import _C
from .copies import local_shard
from .nvme_states import LOST_STATE
from .partition import LAYOUT_KEY

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")


def state_dict_of(opt: Any, sd: dict) -> dict:
    """``sd`` (torch's state_dict of ``opt``, after its worker settled) made a CPUAdamW's."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if opt._states.nvme:
        sd["state"] = {k: opt._states.materialize_or_mark(params[k], opt.state[params[k]], opt.param_groups)
                       for k in sd["state"]}
    index = {i: p for i, p in enumerate(params)}
    state = {}
    for k, s in sd["state"].items():
        p = index.get(k)
        if p is not None and p.dtype == torch.float32 and "master" in s:
            s = {n: v for n, v in s.items() if n != "master"}
        state[k] = s
    sd["state"] = state
    if opt._sharded:
        sd["state"] = {k: as_dtensors(s, params[k]) for k, s in state.items()}
    if opt._partition is not None:  # Note [Partitioned optimizer]: whose share this is
        sd[LAYOUT_KEY] = opt._partition.layout
    return sd


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
    lost = [k for k, s in state_dict.get("state", {}).items() if isinstance(s, dict) and LOST_STATE in s]
    if lost:
        params = [p for g in opt.param_groups for p in g["params"]]
        raise _C.TierflowError(_C.lost_states_refusal(
            [opt._states.describe(params[k], opt.param_groups) if isinstance(k, int) and k < len(params)
             else repr(k) for k in lost]))
    layout = state_dict.get(LAYOUT_KEY)
    if opt._partition is not None:
        opt._partition.check_loaded(states_by_param(state_dict, opt.param_groups), layout)
    elif layout is not None and not opt.partition_pending():
        raise _C.TierflowError(_C.partition_layout_refusal(layout, None))
    return layout


def master_from(opt: Any, saved: Optional[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    # A saved master is used only where it is consistent with the parameter:
    # a checkpoint that went through torch.optim may carry a stale one.
    value = opt._copies.source(p)
    if saved is None or p.dtype == torch.float32:
        return value
    if saved.shape == p.shape and torch.equal(saved.to(p.dtype), value.to(saved.device)):
        return saved
    return value


def load(opt: Any, state_dict: dict, torch_load: Callable[[dict], None]) -> None:
    """CPUAdamW.load_state_dict: refused before anything changes (check_loadable); else torch's load
    (``torch_load``), the shared param groups kept, and each parameter's state restored in fp32 on its tier."""
    layout = check_loadable(opt, state_dict)
    if opt._streaming is not None:
        opt._wait_worker()
        opt._streaming.stream.restore_grads()  # the next step() still takes this backward's gradients
        opt._streaming.stream.end_window()  # early steps read the state being replaced
        opt._streaming.stream.synchronize()
    # Where every parameter steps in step() (no stream) or FSDP2's shards (whose next step is step()'s: a
    # stale master turns the stream off for it), a saved master is taken as it is and the next step checks it
    # against its parameter (reconcile_master): the model may be loaded after the optimizer, as
    # torch.distributed.checkpoint's set_state_dict does.
    reconcile = (opt._streaming is None or opt._sharded) and not opt._states.nvme
    # torch casts state to the parameter's dtype; keep the fp32 originals (FSDP2: this rank's shards).
    originals = {k: {n: local_shard(v) for n, v in s.items() if n in _STATE_KEYS}
                 for k, s in state_dict["state"].items()}
    stores = opt._states.stores(opt.state)  # torch replaces opt.state: the NVMe stores are written again
    groups, dicts = opt.param_groups, list(opt.param_groups)
    torch_load(state_dict)
    # torch puts fresh group dicts in a fresh list; keep the shared ones (Note [Shared param groups]).
    for shared, loaded in zip(dicts, opt.param_groups):
        if shared is not loaded:
            shared.clear()
            shared.update(loaded)
    groups[:] = dicts
    opt.param_groups = groups
    if opt._partition is not None:  # a whole state dict: the other ranks keep theirs
        opt._partition.drop_others(opt.state)
    else:  # checked when the partition is made (DDP seen after this load)
        opt._loaded_layout = layout
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        for p, key in zip(group["params"], saved["params"]):
            if p in opt.state and key in originals:
                restore_state(opt, p, group, originals[key], reconcile, stores.get(p))
    opt._master_stale = reconcile


def restore_state(opt: Any, p: torch.Tensor, group: dict, original: dict, reconcile: bool, store: Any) -> None:
    """After torch's load: p's state in fp32 host tensors of its own (``original``: the loaded fp32 states,
    which torch cast to p's dtype), a master (the loaded one where it is consistent, or taken as it is when
    ``reconcile``: the next step checks it against p), and back to its tier (``store``: the NVMe store it had
    before the load, written in place)."""
    state = opt.state[p]
    shard = local_shard(p)  # FSDP2: this rank's shard
    for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        if name in original:
            fresh = opt._copies.host(shard, False)
            fresh.copy_(original[name])
            state[name] = fresh
    if group["amsgrad"] and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = opt._copies.host(shard, True)
    master = opt._copies.host(shard, False)
    saved = original.get("master")
    if reconcile and saved is not None and saved.shape == shard.shape:
        master.copy_(saved)  # the next step keeps it where the parameter is its rounding
    else:
        master.copy_(master_from(opt, saved, shard))
    state["master"] = master
    state["step"] = torch.tensor(float(state.get("step", 0.0)), dtype=torch.float32)
    if opt._states.nvme:
        opt._states.reserve([(p, group)])
        opt._states.to_nvme(p, state, group, store)
    else:
        opt._register_state(p)


def states_by_param(state_dict: dict, groups: list) -> dict:
    """The parameters of ``groups`` that ``state_dict`` holds a state for, as {param: state} (torch maps saved
    indices to parameters by their order across the groups)."""
    saved = [k for g in state_dict.get("param_groups", []) for k in g["params"]]
    params = [p for g in groups for p in g["params"]]
    states = state_dict.get("state", {})
    return {p: states[k] for k, p in zip(saved, params) if k in states}
