"""CPUAdamW partitioned across DDP's ranks: Note [Partitioned optimizer]
(optimizer/include/tierflow/optimizer/distributed_ranks.hpp decides the owners, the broadcasts and the refusals:
_C.distributed; this adapts them to torch.distributed: which tensors are this rank's, the ranks' agreement before
the weights move, and their broadcast)."""

from __future__ import annotations

import time
import weakref
from typing import Optional

import torch

from .. import _C

LAYOUT_KEY = "tierflow_partition"  # a state dict's key for the share it holds: (rank, world_size, owners)


class Partition:
    """Which rank owns each parameter of one optimizer under one DDP module, the ranks' agreement at step(), and
    the weights' broadcast."""

    def __init__(self, params: list, ddp: torch.nn.Module) -> None:
        dist = torch.distributed
        group = ddp.process_group
        self._ddp = weakref.ref(ddp)
        self.group = group
        self.params = list(params)
        reduced = {id(p) for p in getattr(ddp, "_module_parameters", ddp.parameters())}
        self.share = _C.distributed.partition_ranks(
            [(p.numel(), p.element_size(), p.requires_grad and id(p) in reduced) for p in self.params],
            dist.get_rank(group), dist.get_world_size(group))
        self.rank, self.world_size, self.owners = self.share.rank, self.share.world_size, list(self.share.owners)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # Global ranks of the group's ranks: broadcast names its source in the default group's numbering.
        self._source = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
        self.stats = {"rank": self.rank, "world_size": self.world_size, "owned_elements": self.share.owned_elements,
                      "elements": self.share.elements, "owned_parameters": self.share.owned_parameters,
                      "parameters": len(self.owners), "broadcasts": 0, "broadcast_bytes": 0,
                      "broadcast_host_ms": 0.0}

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank keeps p's states and steps it (one every rank steps, or not the optimizer's: yes)."""
        i = self._index.get(id(p))
        return i is None or self.share.owns(i)

    @property
    def layout(self) -> tuple:
        """(rank, world_size, owners): what a state dict of this rank's share records (LAYOUT_KEY)."""
        return self.share.layout

    def check_loaded(self, state: dict, saved_layout: Optional[tuple]) -> None:
        """Refuses a state dict that is not this rank's share of this partition, nor a whole one (Note
        [Partitioned optimizer]); ``state``: {param: its loaded state}; ``saved_layout``: the dict's LAYOUT_KEY."""
        has = [len(state.get(p, {})) > 0 for p in self.params]
        why = _C.distributed.loaded_share_refusal(self.share, saved_layout, has)
        if why is not None:
            raise _C.TierflowError(why)

    def drop_others(self, state: dict) -> None:
        """Forgets the states of parameters other ranks own (a whole state dict loaded: theirs are kept there)."""
        for p in self.params:
            if not self.owns(p) and p in state:
                del state[p]

    def refuse_join(self) -> None:
        """step() under DDP's join() (uneven inputs), refused at the first step() after join() was entered, on every
        rank alike, before anything changes."""
        config = getattr(self._ddp(), "_join_config", None)
        why = _C.distributed.partitioned_join_refusal(config is not None and bool(config.enable))
        if why is not None:
            raise _C.TierflowError(why)

    def agree(self, failed: bool, skipped: bool) -> None:
        """Before the weights move, every rank says how its step() went (one all-reduce of two flags): raises on
        every rank when one failed or when the ranks did not all skip or all step, so that no rank waits in a
        broadcast another will not join."""
        device = self.params[0].device if self.params else torch.device("cpu")
        flags = torch.tensor([float(failed), float(skipped)], device=device)
        torch.distributed.all_reduce(flags, group=self.group)
        why = _C.step_agreement_refusal(failed, int(flags[0]), int(flags[1]), self.world_size)
        if why is not None:
            raise _C.TierflowError(why)

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every partitioned parameter's new weights from its owner to the other ranks, in place, in the share's
        order (the same on every rank). Every rank calls it at every step() that steps: a rank that skips step()
        while the others step makes them wait (agree() catches the other cases)."""
        t0 = time.perf_counter()
        dist = torch.distributed
        works, copies = [], []
        for i in self.share.broadcasts:
            data, owner = self.params[i].detach(), self.owners[i]
            buf = data if data.is_contiguous() else data.contiguous()
            works.append(dist.broadcast(buf, src=self._source[owner], group=self.group, async_op=True))
            if buf is not data and owner != self.rank:
                copies.append((data, buf))
        for w in works:
            w.wait()  # on NCCL: the current stream waits, the host does not
        for data, buf in copies:
            data.copy_(buf)
        self.stats["broadcasts"] += 1
        self.stats["broadcast_bytes"] += self.share.broadcast_bytes
        self.stats["broadcast_host_ms"] += (time.perf_counter() - t0) * 1e3
