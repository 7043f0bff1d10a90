"""The CPU AdamW's states as they sit on a tier: the space they need, checked at
wrap, and, with states on NVMe, their step, their reads and writes, and what a
step that fails part way leaves. CPUAdamW owns one StateTier and hands it its
param groups and the state of the parameters a call is about.

What each decision is (the space the states need and its error, a
parameter's description, the error of a step that failed part way, the
grouping of a step's parameters) is decided torch-free in
optimizer/include/tierflow/optimizer/state_tier.hpp, whose Note [NVMe
optimizer faults] says how a step that fails part way is retried; this module
keeps what touches tensors: which parameters, their gradients and states.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import _C
from .accepted import check_grad
from .copies import MOMENT_DTYPES, DeviceCopies, local_shard

#: The key that marks a state lost to NVMe corruption in state_dict() (Note [NVMe optimizer faults]).
LOST_STATE = _C.LOST_STATE_KEY


def state_bytes(p: torch.Tensor, group: dict, state_format: str = "fp32") -> int:
    """The NVMe state of one parameter: fp32 master, exp_avg and exp_avg_sq in ``state_format`` (Note [Optimizer
    state formats]) and, with amsgrad, an fp32 max_exp_avg_sq."""
    return _C.nvme_optimizer_state_bytes(local_shard(p).numel(), bool(group["amsgrad"]),  # FSDP2: this rank's shard
                                         state_format)


class StateTier:
    """Where CPUAdamW's states sit, the host pool or NVMe (TIERFLOW_OFFLOAD_OPTIMIZER): space checks, the
    NVMe states' step and I/O, and their faults (Note [NVMe optimizer faults])."""

    def __init__(self, runtime: "_C.Runtime", plan: "_C.StepPlan", names: dict) -> None:
        self._runtime = runtime
        self._host_memory = runtime.settings().host_memory
        self.nvme = plan.states_on_nvme  # Note [Step plan]
        # How the moments are kept (Note [Optimizer state formats]): on NVMe too, in the same bytes as on the host
        # (Note [Optimizer states on NVMe]).
        self.format = plan.format
        self._names = names  # id(param) -> its name in the model, for error messages
        self._reserved: set = set()  # ids of parameters whose NVMe state space is reserved
        # Note [NVMe optimizer faults]: param -> (gradient, its version, step count after) of a step taken.
        self._done: dict = {}

    def new_window(self) -> None:
        """A new backward or zero_grad(): the next step() is a step for every parameter."""
        self._done.clear()

    # -- space and faults (Note [NVMe optimizer faults]) --------------------------
    def describe(self, p: torch.Tensor, param_groups: list) -> str:
        """A parameter as a user knows it: its name in the model, else its group and index; and its shape."""
        name = self._names.get(id(p))
        where = None
        if name is None:
            for gi, group in enumerate(param_groups):
                for j, q in enumerate(group["params"]):
                    if q is p:
                        where = (gi, j)
        return _C.describe_parameter(name, where, list(p.shape))

    def check_space(self, param_groups: list, gpu_share: set) -> None:
        """What the states need, checked when the optimizer is made rather than in its first step:
        the pinned host pool must hold the states (host tier) or the two buffers they stream through
        (NVMe tier), and NVMe space for them is reserved now. ``gpu_share``: ids of parameters that
        step on the GPU (their states are not here)."""
        todo = [(p, g) for g in param_groups for p in g["params"] if p.requires_grad and id(p) not in gpu_share]
        if not todo:
            return
        budget = int(self._runtime.stats()["host_pool"]["budget_bytes"])
        # FSDP2's parameters: each rank holds its shard's states only. A parameter of the runtime's device also
        # holds its gradient's host copy and its new weight's staging during a step (state_tier.hpp).
        _C.check_optimizer_state_pool([(local_shard(p).numel(), bool(g["amsgrad"]), self._moved_element_bytes(p))
                                       for p, g in todo], self.nvme, budget, str(self._host_memory), self.format)
        if self.nvme:
            self.reserve(todo)

    def _moved_element_bytes(self, p: torch.Tensor) -> int:
        """Bytes per element that p's step moves through pinned memory (its gradient in, its new weight out):
        its element size when it lives on the runtime's device, else 0 (a CPU parameter steps in place)."""
        shard = local_shard(p)
        return shard.element_size() if self._runtime.on_device(shard) else 0

    def reserve(self, todo: list) -> None:
        """Grows the swap files for these (param, group) states now (Note [NVMe space]); raises naming the
        need and the free space, and then reserves nothing."""
        todo = [(p, g) for p, g in todo if id(p) not in self._reserved]
        if todo:
            self._runtime.nvme_adam_reserve([state_bytes(p, g, self.format) for p, g in todo])
            self._reserved.update(id(p) for p, _ in todo)

    def stepped_already(self, p: torch.Tensor, state: Any) -> bool:
        """True when p (whose state is ``state``, or None) stepped with this very gradient in a step() that then
        failed for others (Note [NVMe optimizer faults]): a retry must not step it twice."""
        done = self._done.get(p)
        return (done is not None and p.grad is done[0] and _version(p.grad) == done[1] and state is not None
                and "step" in state and float(state["step"]) == done[2])

    def step_error(self, problems: list, param_groups: list) -> Exception:
        """One error for the parameters a step() could not step: [(param, lost?, reason)]."""
        return _C.IOError(_C.nvme_step_error([(self.describe(p, param_groups), is_lost, reason)
                                              for p, is_lost, reason in problems]))

    # -- states on NVMe ------------------------------------------------------------
    def add(self, p: torch.Tensor, group: dict, value: torch.Tensor) -> dict:
        """A fresh NVMe state for p (its master from ``value``, p's current value), as the entries of its state dict."""
        master = value.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        return {"nvme_key": _C.nvme_adam_add_in(self._runtime, master, bool(group["amsgrad"]), self.format),
                "amsgrad": bool(group["amsgrad"])}

    @staticmethod
    def stores(state: Any) -> dict:
        """The NVMe stores of an optimizer's ``state``, {param: (key, amsgrad)}: to_nvme writes a loaded state into
        its parameter's store, not a second, unreserved one beside it (load_state_dict replaces the states)."""
        return {p: (s["nvme_key"], s.get("amsgrad")) for p, s in state.items() if "nvme_key" in s}

    def to_nvme(self, p: torch.Tensor, state: dict, group: dict, store: Optional[tuple] = None) -> None:
        """Moves a parameter's state tensors into the NVMe store (in place of the tensors): ``store``'s (stores())
        when it has the room (the same amsgrad), else a new one."""
        amsgrad = bool(group["amsgrad"])
        if store is not None and store[1] == amsgrad and "nvme_key" not in state:
            state["nvme_key"] = store[0]
        flat = lambda t: t.detach().reshape(-1).to(torch.float32).contiguous()  # noqa: E731
        master = flat(state.pop("master"))
        m, v = self._moments_for_nvme(state.pop("exp_avg"), state.pop("exp_avg_sq"), master.numel())
        vmax = flat(state.pop("max_exp_avg_sq")) if amsgrad and "max_exp_avg_sq" in state else (
            torch.zeros_like(master) if amsgrad else None)
        state.pop("max_exp_avg_sq", None)
        if "nvme_key" not in state:
            state["nvme_key"] = _C.nvme_adam_add_in(self._runtime, master, amsgrad, self.format)
        _C.nvme_adam_write_in(self._runtime, state["nvme_key"], master, m, v, vmax)
        state["amsgrad"] = amsgrad

    def _moments_for_nvme(self, m: torch.Tensor, v: torch.Tensor, numel: int) -> tuple:
        """(m, v) as the NVMe store takes them: in its format as they are (their bytes), else as fp32, which it
        encodes (Note [Optimizer state formats]: decoding then encoding gives the same bytes back)."""
        fmt = _C.moment_format(m)
        if fmt == self.format and _C.moment_format(v) == fmt:
            return m.detach().reshape(-1).contiguous(), v.detach().reshape(-1).contiguous()
        if fmt in ("bf16", "8bit"):  # another packed format: decoded first
            m, v = _C.decode_moments(m.detach().reshape(-1).contiguous(), v.detach().reshape(-1).contiguous(), numel)
        return (m.detach().reshape(-1).to(torch.float32).contiguous(),
                v.detach().reshape(-1).to(torch.float32).contiguous())

    def materialize(self, p: torch.Tensor, state: dict) -> dict:
        """A parameter's NVMe-resident state as CPU tensors, in torch's layout."""
        if "nvme_key" not in state:
            return state
        shape = local_shard(p).shape  # FSDP2: this rank's shard
        n = shape.numel()
        master = torch.empty(n, dtype=torch.float32)
        # The moments in their format, as the host tier keeps them: float32 or bfloat16 shaped like the
        # parameter, or 8bit's one uint8 buffer (Note [Optimizer state formats]).
        fmt = _C.nvme_adam_format(self._runtime, state["nvme_key"])
        dtype = MOMENT_DTYPES[fmt]
        m, v = (torch.empty(_C.moment_bytes(fmt, n) // dtype.itemsize, dtype=dtype) for _ in range(2))
        vmax = torch.empty(n, dtype=torch.float32) if state.get("amsgrad") else None
        _C.nvme_adam_read_in(self._runtime, state["nvme_key"], master, m, v, vmax)
        moment_shape = (m.shape if fmt == "8bit" else shape)
        out = {"step": state["step"], "exp_avg": m.view(moment_shape), "exp_avg_sq": v.view(moment_shape),
               "master": master.view(shape)}
        if vmax is not None:
            out["max_exp_avg_sq"] = vmax.view(shape)
        return out

    def materialize_or_mark(self, p: torch.Tensor, state: dict, param_groups: list) -> dict:
        """materialize, or for a state that cannot be read back the lost marker (Note [NVMe optimizer faults])."""
        try:
            return self.materialize(p, state)
        except _C.IOError as e:
            return {"step": state["step"], LOST_STATE: f"the NVMe state of {self.describe(p, param_groups)} is lost: {e}"}

    # -- the step ------------------------------------------------------------------
    def step_group(self, group: dict, options: dict, state: Any, gpu_share: set, copies: DeviceCopies,
                   init_state: Callable[[torch.Tensor, dict], dict], master_stale: bool) -> list:
        """States on NVMe: one pipelined pass per step number (Note [Optimizer states on NVMe]).

        ``state``: the optimizer's state; ``init_state(p, group)`` makes a parameter's first state;
        ``master_stale``: masters are read again from the parameters. Returns the parameters it could not
        step, [(param, lost?, reason)] (Note [NVMe optimizer faults]); every other parameter with a gradient
        stepped, exactly once per gradient."""
        problems: list = []
        todo = [p for p in group["params"]
                if p.grad is not None and id(p) not in gpu_share and not self.stepped_already(p, state.get(p))]
        # A group added after the optimizer was made reserves its space at its first step.
        fresh = [(p, group) for p in todo if id(p) not in self._reserved and len(state.get(p, {})) == 0]
        if fresh:
            try:
                self.reserve(fresh)
            except (_C.IOError, _C.OutOfMemoryError) as e:
                problems += [(p, False, str(e)) for p, _ in fresh]
                unreserved = {id(p) for p, _ in fresh}
                todo = [p for p in todo if id(p) not in unreserved]
        members: list = []  # (param, its state, its gradient on the host, its output, copied back?)
        write_error: Optional[BaseException] = None
        for p in todo:
            grad = local_shard(p.grad).detach()  # FSDP2: the shard of the reduce-scattered gradient
            check_grad(grad)
            shard = local_shard(p)
            s = state[p]
            if len(s) == 0:
                try:
                    s = init_state(p, group)
                except (_C.IOError, _C.OutOfMemoryError) as e:
                    problems.append((p, False, str(e)))  # no state made: the next step() starts it again
                    continue
            elif master_stale:
                full = self.materialize(p, s)
                copies.read_into(full["master"], shard)
                s.update({k: v for k, v in full.items() if k != "step"})
                self.to_nvme(p, s, group)
            if copies.staged(grad):
                host_grad, transfer, _src = copies.fetch(grad)
                transfer.wait()
                grad = host_grad.reshape(-1)
            else:
                grad = grad.reshape(-1)
                if grad.device.type != "cpu" or not grad.is_contiguous():
                    grad = grad.to("cpu").contiguous()
            if _C.StepPlan.weight_target(False, shard.device.type == "cpu" and not copies.staged(shard),
                                         shard.is_contiguous()) == _C.WeightTarget.parameter:
                out, copy = shard.detach().reshape(-1), False
            else:
                out, copy = copies.staging(shard, flat=True), True
            members.append((p, s, grad, out, copy))
        for step, batch in _C.group_by_step([int(m[1]["step"].item()) + 1 for m in members]):
            batch = [members[i] for i in batch]
            failed, first_error, lost = self._runtime.nvme_adam_step(
                options, step, [s["nvme_key"] for _, s, _, _, _ in batch], [g for _, _, g, _, _ in batch],
                [out for _, _, _, out, _ in batch])
            failed, lost = set(failed), set(lost)
            for i, (p, s, _grad, out, copy) in enumerate(batch):
                if i in failed:  # kept its previous state and weight (or lost its state): nothing to copy
                    problems.append((p, i in lost, first_error))
                    continue
                s["step"] += 1
                self._done[p] = (p.grad, _version(p.grad), float(s["step"]))
                if copy:
                    shard = local_shard(p)
                    try:  # past a failed write (its values kept in host memory: Note [Parameter moves])
                        copies.write_param(shard, out.view(shard.shape))
                    except Exception as e:  # noqa: BLE001  raised below, once every stepped weight is written
                        write_error = write_error or e
        if write_error is not None and not problems:  # (with problems, their error is raised for a retry)
            raise write_error
        return problems


def _version(grad: torch.Tensor) -> int:
    """A gradient's version; FSDP2's DTensor's with its local tensor's (a foreach op on DTensors moves neither
    alone: tierflow._fsdp_feed)."""
    local = getattr(grad, "_local_tensor", None)
    return grad._version + (local._version if local is not None else 0)


def fill_lost_states(state_dict: dict, earlier: dict) -> dict:
    """A copy of ``state_dict`` whose states marked lost (Note [NVMe optimizer faults]) are taken from
    ``earlier``, an older checkpoint's optimizer state dict; raises naming any it cannot fill."""
    out = dict(state_dict)
    out["state"] = dict(state_dict["state"])
    missing = []
    for k, s in state_dict["state"].items():
        if LOST_STATE in s:
            old = earlier.get("state", {}).get(k)
            if old is None or LOST_STATE in old:
                missing.append(k)
            else:
                out["state"][k] = old
    if missing:
        raise _C.TierflowError(_C.unfilled_lost_states([repr(k) for k in missing]))
    return out
