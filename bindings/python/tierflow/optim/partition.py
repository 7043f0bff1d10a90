"""CPUAdamW partitioned across DDP's ranks: Note [Partitioned optimizer]
(optimizer/include/tierflow/optimizer/partition.hpp decides the owners and the refusals; this adapts them to
torch.distributed: which tensors are this rank's, and the broadcast of the new weights)."""

from __future__ import annotations

import time
import weakref

import torch

from .. import _C


class Partition:
    """Which rank owns each parameter of one optimizer under one DDP process group, and the weights' broadcast."""

    def __init__(self, params: list, ddp: torch.nn.Module) -> None:
        dist = torch.distributed
        group = ddp.process_group
        self._ddp = weakref.ref(ddp)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.params = list(params)
        elements = [p.numel() for p in self.params]
        owners = _C.partition_parameters(elements, self.world_size)
        self._owner = {id(p): o for p, o in zip(self.params, owners)}
        self.owners = owners
        # Global ranks of the group's ranks: broadcast names its source in the default group's numbering.
        self._source = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
        per_rank = _C.owned_elements(owners, elements, self.world_size)
        self.stats = {"rank": self.rank, "world_size": self.world_size, "owned_elements": per_rank[self.rank],
                      "elements": sum(elements), "owned_parameters": owners.count(self.rank),
                      "parameters": len(owners), "broadcasts": 0, "broadcast_bytes": 0, "broadcast_ms": 0.0}

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank keeps p's states and steps it (a parameter the optimizer does not hold: yes)."""
        return self._owner.get(id(p), self.rank) == self.rank

    def check_loaded(self, state: dict) -> None:
        """Refuses states that are another rank's partition (Note [Partitioned optimizer])."""
        has = [len(state.get(p, {})) > 0 for p in self.params]
        why = _C.loaded_partition_refusal(self.owners, has, self.rank, self.world_size)
        if why is not None:
            raise _C.TierflowError(why)

    def drop_others(self, state: dict) -> None:
        """Forgets the states of parameters other ranks own (a whole state dict loaded: theirs are kept there)."""
        for p in self.params:
            if not self.owns(p) and p in state:
                del state[p]

    def refuse_join(self) -> None:
        """step() under DDP's join() (uneven inputs): a rank that ran out of inputs takes no step(), so it would
        neither step its parameters nor send their weights; refused at the first step() inside join(), on every
        rank alike, before anything changes."""
        ddp = self._ddp()
        config = getattr(ddp, "_join_config", None)
        if config is not None and config.enable:
            raise _C.TierflowError(
                "tierflow's CPU optimizer is partitioned across the DDP ranks (TIERFLOW_PARTITION_OPTIMIZER=on, the "
                "default; each rank steps its own parameters and broadcasts their new weights in step()), and DDP's "
                "join() lets a rank that ran out of inputs skip step(), so its parameters would not be stepped and "
                "the others would wait for their weights; accepted under join(): TIERFLOW_PARTITION_OPTIMIZER=off "
                "(partition_optimizer='off': every rank steps every parameter), or even inputs without join()")

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every parameter's new weights from its owner to the other ranks, in place (all ranks call it, in the
        same order: step() on every rank, as DDP needs anyway)."""
        t0 = time.perf_counter()
        dist = torch.distributed
        works, copies = [], []
        for p, owner in zip(self.params, self.owners):
            data = p.detach()
            buf = data if data.is_contiguous() else data.contiguous()
            works.append(dist.broadcast(buf, src=self._source[owner], group=self.group, async_op=True))
            if buf is not data and owner != self.rank:
                copies.append((data, buf))
            self.stats["broadcast_bytes"] += buf.numel() * buf.element_size()
        for w in works:
            w.wait()
        for data, buf in copies:
            data.copy_(buf)
        self.stats["broadcasts"] += 1
        self.stats["broadcast_ms"] += (time.perf_counter() - t0) * 1e3
