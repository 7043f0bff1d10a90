"""A drop-in replacement for torch.optim.Adam / AdamW that steps on the CPU."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import _C

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class CPUAdamW(torch.optim.Optimizer):
    """Adam / AdamW with fp32 master weights and moments in the pinned host pool.

    The update is tierflow's C++ CpuAdam on oneTBB, with the semantics of
    ``torch.optim.AdamW`` (or ``Adam`` when a group has
    ``decoupled_weight_decay=False``); see Note [Adam semantics]. The updated
    master is written back into each parameter in the parameter's dtype. Its
    ``state_dict`` has torch's layout plus an fp32 ``master`` per parameter,
    and loads into ``torch.optim.AdamW``; torch's loads into it.
    """

    def __init__(self, params: Any, runtime: "_C.Runtime", lr: float = 1e-3,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self._runtime = runtime
        self._master_stale = False

    # -- construction from an existing optimizer ---------------------------------
    @classmethod
    def replace(cls, optimizer: torch.optim.Optimizer, runtime: "_C.Runtime",
                model: Optional[torch.nn.Module] = None) -> "CPUAdamW":
        """A CPUAdamW with ``optimizer``'s groups, hyperparameters and state.

        Accepts exactly ``torch.optim.AdamW`` and ``torch.optim.Adam``; anything
        else (another algorithm, or a subclass that may change ``step``) raises
        ``TierflowError`` naming it and what is accepted.
        """
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
            cls_ = type(optimizer)
            public = getattr(torch.optim, cls_.__name__, None) is cls_
            name = f"torch.optim.{cls_.__name__}" if public else f"{cls_.__module__}.{cls_.__qualname__}"
            raise _C.TierflowError(
                f"tierflow.wrap: cannot replace an optimizer of type {name}; "
                "accepted: torch.optim.AdamW, torch.optim.Adam. "
                "Pass offload_optimizer='none' to keep your optimizer on the device.")
        for i, g in enumerate(optimizer.param_groups):
            if g.get("differentiable"):
                raise _C.TierflowError(f"tierflow.wrap: param group {i} has differentiable=True, "
                                       "which the CPU optimizer cannot honour; accepted: differentiable=False")
            for p in g["params"]:
                if not p.is_floating_point() or p.dtype not in _GRAD_DTYPES:
                    raise _C.TierflowError(f"tierflow.wrap: param group {i} holds a parameter of dtype {p.dtype}; "
                                           "accepted: float32, bfloat16, float16")
        adamw = type(optimizer) is torch.optim.AdamW
        defaults = dict(optimizer.defaults)
        new = cls.__new__(cls)
        groups = []
        for g in optimizer.param_groups:
            g = dict(g)
            g.setdefault("decoupled_weight_decay", adamw)
            if adamw:
                g["decoupled_weight_decay"] = True
            groups.append(g)
        defaults.setdefault("decoupled_weight_decay", adamw)
        torch.optim.Optimizer.__init__(new, groups, defaults)
        new._runtime = runtime
        new._master_stale = False
        if len(optimizer.state) > 0:
            new.load_state_dict(optimizer.state_dict())
        if model is not None:
            # model.load_state_dict(...) changes parameters behind the optimizer's back.
            model.register_load_state_dict_post_hook(lambda module, keys: new.mark_master_stale())
        return new

    def mark_master_stale(self) -> None:
        """Parameters were changed outside the optimizer: re-read masters from them at the next step."""
        self._master_stale = True

    # -- state -----------------------------------------------------------------
    def _host(self, like: torch.Tensor, zero: bool) -> torch.Tensor:
        return self._runtime.host_empty(list(like.shape), "float32", zero)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = self._host(p, True)
        state["exp_avg_sq"] = self._host(p, True)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._host(p, True)
        master = self._host(p, False)
        master.copy_(p.detach())
        state["master"] = master
        return state

    def state_dict(self) -> dict:
        """torch's layout; ``master`` is included only for non-fp32 parameters
        (for fp32 ones the parameter itself is the master)."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        index = {i: p for i, p in enumerate(params)}
        state = {}
        for k, s in sd["state"].items():
            p = index.get(k)
            if p is not None and p.dtype == torch.float32 and "master" in s:
                s = {n: v for n, v in s.items() if n != "master"}
            state[k] = s
        sd["state"] = state
        return sd

    @staticmethod
    def _master_from(saved: Optional[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        # A saved master is used only where it is consistent with the parameter:
        # a checkpoint that went through torch.optim may carry a stale one.
        if saved is None or p.dtype == torch.float32:
            return p.detach()
        if saved.shape == p.shape and torch.equal(saved.to(p.dtype), p.detach()):
            return saved
        return p.detach()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a CPUAdamW or torch Adam/AdamW state dict, keeping fp32 precision."""
        # torch casts state to the parameter's dtype; keep the fp32 originals.
        originals = {k: {n: v for n, v in s.items() if n in _STATE_KEYS}
                     for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for p, key in zip(group["params"], saved["params"]):
                if p not in self.state or key not in originals:
                    continue
                state = self.state[p]
                for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if name in originals[key]:
                        fresh = self._host(p, False)
                        fresh.copy_(originals[key][name])
                        state[name] = fresh
                if group["amsgrad"] and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = self._host(p, True)
                master = self._host(p, False)
                master.copy_(self._master_from(originals[key].get("master"), p))
                state["master"] = master
                step = state.get("step", 0.0)
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        self._master_stale = False

    # -- step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adam/AdamW step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        self._master_stale = False
        return loss

    def _step_group(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        options = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                       eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                       amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                       decoupled_weight_decay=bool(group.get("decoupled_weight_decay", True)))
        buckets: dict[int, list] = {}
        copy_back: list = []
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            if grad.is_sparse:
                raise _C.TierflowError("tierflow CPUAdamW: sparse gradients are not supported; accepted: dense gradients")
            if grad.dtype not in _GRAD_DTYPES:
                raise _C.TierflowError(f"tierflow CPUAdamW: gradient dtype {grad.dtype} is not supported; "
                                       "accepted: float32, bfloat16, float16")
            state = self.state[p]
            if len(state) == 0:
                state = self._init_state(p, group)
            elif self._master_stale:
                state["master"].copy_(p.detach())
            state["step"] += 1
            host_grad = grad.detach()
            if host_grad.device.type != "cpu" or not host_grad.is_contiguous():
                host_grad = host_grad.to("cpu").contiguous()
            if p.device.type == "cpu" and p.is_contiguous():
                out = p.detach()
            else:
                out = self._runtime.host_empty(list(p.shape), _DTYPE_NAMES[p.dtype], False)
                copy_back.append((p, out))
            b = buckets.setdefault(int(state["step"].item()), [[], [], [], [], [], []])
            b[0].append(state["master"])
            b[1].append(state["exp_avg"])
            b[2].append(state["exp_avg_sq"])
            b[3].append(state.get("max_exp_avg_sq") if options["amsgrad"] else None)
            b[4].append(host_grad)
            b[5].append(out)
        for step, (masters, ms, vs, vmaxes, grads, outs) in buckets.items():
            self._runtime.adam_step(options, step, masters, ms, vs, vmaxes, grads, outs)
        for p, out in copy_back:
            p.detach().copy_(out)
