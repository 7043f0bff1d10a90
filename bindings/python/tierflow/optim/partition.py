"""CPUAdamW partitioned across DDP's ranks: Note [Partitioned optimizer]
(optimizer/include/tierflow/optimizer/partition.hpp decides the owners and the refusals; this adapts them to
torch.distributed: which tensors are this rank's, the ranks' agreement before the weights move, and their
broadcast)."""

from __future__ import annotations

import time
import weakref
from typing import Optional

import torch

from .. import _C

EVERY_RANK = -1  # the owner of a parameter every rank steps itself (PartitionLayout::kEveryRank)
LAYOUT_KEY = "tierflow_partition"  # a state dict's key for the share it holds: (rank, world_size, owners)


class Partition:
    """Which rank owns each parameter of one optimizer under one DDP module, the ranks' agreement at step(), and
    the weights' broadcast."""

    def __init__(self, params: list, ddp: torch.nn.Module) -> None:
        dist = torch.distributed
        group = ddp.process_group
        self._ddp = weakref.ref(ddp)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.params = list(params)
        # Only what DDP reduces is partitioned: a frozen parameter, one DDP ignores or one outside the DDP module
        # has no reduced gradient to step from on its owner, so every rank steps it itself, as unpartitioned.
        reduced = {id(p) for p in getattr(ddp, "_module_parameters", ddp.parameters())}
        shared = [p for p in self.params if p.requires_grad and id(p) in reduced]
        owned = dict(zip(map(id, shared), _C.partition_parameters([p.numel() for p in shared], self.world_size)))
        self.owners = [owned.get(id(p), EVERY_RANK) for p in self.params]
        self._owner = dict(zip(map(id, self.params), self.owners))
        self._shared = [(p, o) for p, o in zip(self.params, self.owners) if o != EVERY_RANK]
        # Global ranks of the group's ranks: broadcast names its source in the default group's numbering.
        self._source = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
        elements = [p.numel() for p in self.params]
        mine = sum(n for n, o in zip(elements, self.owners) if o in (self.rank, EVERY_RANK))
        self.stats = {"rank": self.rank, "world_size": self.world_size, "owned_elements": mine,
                      "elements": sum(elements), "owned_parameters": sum(o in (self.rank, EVERY_RANK)
                                                                          for o in self.owners),
                      "parameters": len(self.owners), "broadcasts": 0, "broadcast_bytes": 0,
                      "broadcast_host_ms": 0.0}

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank keeps p's states and steps it (one every rank steps, or not the optimizer's: yes)."""
        return self._owner.get(id(p), EVERY_RANK) in (self.rank, EVERY_RANK)

    @property
    def layout(self) -> tuple:
        """(rank, world_size, owners): what a state dict of this rank's share records (LAYOUT_KEY)."""
        return (self.rank, self.world_size, list(self.owners))

    def check_loaded(self, state: dict, saved_layout: Optional[tuple]) -> None:
        """Refuses a state dict that is not this rank's share of this partition, nor a whole one (Note
        [Partitioned optimizer]); ``state``: {param: its loaded state}; ``saved_layout``: the dict's LAYOUT_KEY."""
        why = _C.partition_layout_refusal(saved_layout, self.layout)
        if why is None and saved_layout is None:  # no layout recorded (torch.distributed.checkpoint drops it)
            has = [len(state.get(p, {})) > 0 for p in self.params]
            owners = [o if o != EVERY_RANK else self.rank for o in self.owners]
            why = _C.loaded_partition_refusal(owners, has, self.rank, self.world_size)
        if why is not None:
            raise _C.TierflowError(why)

    def drop_others(self, state: dict) -> None:
        """Forgets the states of parameters other ranks own (a whole state dict loaded: theirs are kept there)."""
        for p in self.params:
            if not self.owns(p) and p in state:
                del state[p]

    def refuse_join(self) -> None:
        """step() under DDP's join() (uneven inputs): a rank that ran out of inputs takes no step(), so it would
        neither step its parameters nor send their weights; refused at the first step() after join() was
        entered, on every rank alike, before anything changes."""
        ddp = self._ddp()
        config = getattr(ddp, "_join_config", None)
        if config is not None and config.enable:
            raise _C.TierflowError(
                "tierflow's CPU optimizer is partitioned across the DDP ranks (TIERFLOW_PARTITION_OPTIMIZER=on: "
                "each rank steps its own parameters and broadcasts their new weights in step()), and DDP's join() "
                "was entered on this DDP module (its join configuration stays on after the join block): a rank "
                "that ran out of inputs skips step(), so its parameters would not be stepped and the others would "
                "wait for their weights; accepted with join(): TIERFLOW_PARTITION_OPTIMIZER=off "
                "(partition_optimizer='off', the default: every rank steps every parameter)")

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
        """Every partitioned parameter's new weights from its owner to the other ranks, in place. Every rank calls
        it at every step() that steps, in the same order (the parameters' order, fixed when the partition was
        made): a rank that skips step() while the others step makes them wait (agree() catches the other cases)."""
        t0 = time.perf_counter()
        dist = torch.distributed
        works, copies = [], []
        for p, owner in self._shared:
            data = p.detach()
            buf = data if data.is_contiguous() else data.contiguous()
            works.append(dist.broadcast(buf, src=self._source[owner], group=self.group, async_op=True))
            if buf is not data and owner != self.rank:
                copies.append((data, buf))
            self.stats["broadcast_bytes"] += buf.numel() * buf.element_size()
        for w in works:
            w.wait()  # on NCCL: the current stream waits, the host does not
        for data, buf in copies:
            data.copy_(buf)
        self.stats["broadcasts"] += 1
        self.stats["broadcast_host_ms"] += (time.perf_counter() - t0) * 1e3
