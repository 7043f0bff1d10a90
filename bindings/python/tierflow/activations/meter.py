"""Measures what autograd keeps for backward, without changing anything."""

from __future__ import annotations

import torch


class SavedActivationMeter:
    """Counts the bytes of distinct storages autograd saves in a region.

    Used for the baseline in comparisons: the same rule tierflow's own
    accounting uses (each storage once, parameters and leaves that require
    grad excluded), but nothing is moved. ``peak_bytes`` is the largest total
    seen over the forward passes measured.
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._current = 0
        self._seen: set[int] = set()

    def begin_forward(self) -> None:
        """Starts counting a new forward pass."""
        self._current = 0
        self._seen.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and not (t.is_leaf and t.requires_grad):
            key = t.untyped_storage().data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self._current += t.untyped_storage().nbytes()
                self.peak_bytes = max(self.peak_bytes, self._current)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context manager that meters the forward passes run inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
