"""The user's ``torch.nn.utils.clip_grad_norm_`` seen by the gradient stream.

Note [Clip picked up]
~~~~~~~~~~~~~~~~~~~~~
Training loops clip between ``backward()`` and ``step()``: transformers'
Trainer does by default (``max_grad_norm=1.0``, through accelerate's
``clip_grad_norm_``), and so do most hand-written loops. The clip multiplies
every gradient in place, which bumps its version, so a step the CPU AdamW took
during backward (Note [Gradient streaming]) no longer matches ``p.grad`` and
``step()`` used to fetch the gradient again and step it again: correct, and
every early step wasted, even when the clip did not bind (torch multiplies by
1.0 then).

The clip is one known operation: ``p.grad *= c`` for every gradient, with
``c = clamp(max_norm / (total_norm + 1e-6), max=1)`` computed by torch. So
tierflow watches it. While a CPU optimizer with a gradient stream is alive,
``torch.nn.utils.clip_grad_norm_`` is this module's wrapper, which runs
torch's function unchanged and around it tells each stream:

- ``begin_clip``: which streamed gradients are still exactly those copied to
  the host (same tensor, same version);
- ``end_clip(max_norm, c)``: those whose version moved by exactly one (the
  clip's multiply and nothing else) still count as the gradient streamed,
  scaled by ``c``. ``step()`` then commits their early step when ``c`` is
  exactly 1 and otherwise steps them again from the landed host copy with
  ``c`` as the kernel's ``grad_scale`` (no second copy), the same as
  tierflow's own clip. The kernel multiplies in fp32, which rounds as torch's
  in-place multiply only for fp32 gradients; a bf16 or fp16 gradient the clip
  scaled by ``c != 1`` is stepped from ``p.grad`` as before. The stream also
  learns ``max_norm``, so from the next backward its running norm stops
  speculation once the clip is certain to bind, as with
  ``TIERFLOW_MAX_GRAD_NORM``.

With a clip of its own (``TIERFLOW_MAX_GRAD_NORM``) the stream keeps its
steps only through a user clip whose coefficient is exactly 1, which changed
no value: a norm read, as transformers 5's Trainer does at every step to log
``grad_norm`` (``clip_grad_norm_(max_norm=inf)``, also with
``max_grad_norm=0``); tierflow's own clip then applies as before. A user clip
that binds on top of tierflow's changed ``p.grad``, which ``step()`` steps.

FSDP2's DTensor gradients: torch's clip multiplies them with
``_foreach_mul_``, which on DTensors moves no version counter; the wrapper
moves the version of each it left unmoved, as the multiply of a plain tensor
would, so the stream sees the clip there too (tierflow._fsdp_feed), and the
coefficient is taken from the norm over every rank's shards.

Nothing about the result changes: ``p.grad`` holds the clipped gradient as
torch left it, and the step is bit-identical to the one from ``p.grad``
(tested against tierflow's own clip in ``test_hf_trainer.py``). The wrapper
replaces the attribute ``torch.nn.utils.clip_grad_norm_`` (where accelerate,
Trainer and ``torch.nn.utils.clip_grad_norm_(...)`` look it up at each call);
a caller that imported the function itself before tierflow gets no pickup,
and only loses the overlap.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

_watching: "weakref.WeakSet" = weakref.WeakSet()  # GradientStreaming objects that see the user's clip
_torch_clip = None  # torch's clip_grad_norm_, once replaced


def watch(streaming: Any) -> None:
    """The user's clip_grad_norm_ calls are shown to ``streaming.stream`` (a CPUAdamW's GradientStreaming,
    which lives as long as its optimizer) from now on, while it lives."""
    global _torch_clip
    _watching.add(streaming)
    if _torch_clip is not None:
        return
    _torch_clip = torch.nn.utils.clip_grad_norm_

    @functools.wraps(_torch_clip)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        watching = list(_watching)
        streams = [s.stream for s in watching]
        if not streams:
            return _torch_clip(parameters, max_norm, *args, **kwargs)
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        else:
            parameters = list(parameters)  # a generator is read once, by torch
        feeds = [s.fsdp_feed for s in watching if s.fsdp_feed is not None]
        for feed in feeds:  # FSDP2: a change before the clip no counter showed (a GradScaler's unscale) first
            feed.mark_unseen_changes()
        for s in streams:
            s.begin_clip()
        sharded = _dtensor_grads(parameters)
        total = _torch_clip(parameters, max_norm, *args, **kwargs)
        _show_the_multiply(sharded)
        for feed in feeds:
            feed.refresh()
        with torch.no_grad():  # torch's own coefficient, in the norm's dtype
            norm = total.full_tensor() if hasattr(total, "full_tensor") else total  # FSDP2: every rank's shards
            coefficient = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        for s in streams:
            s.end_clip(float(max_norm), coefficient)
        return total

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def _dtensor_grads(parameters: list) -> list:
    """FSDP2's DTensor gradients among ``parameters``' and their versions (the DTensor's and its local tensor's)."""
    out = []
    for p in parameters:
        g = getattr(p, "grad", None)
        local = getattr(g, "_local_tensor", None)
        if local is not None:
            out.append((g, g._version + local._version))
    return out


def _show_the_multiply(sharded: list) -> None:
    """torch's clip multiplies every gradient with _foreach_mul_, which on DTensors moves no version counter:
    the gradients it left at their versions get one more, as a multiply in place of a plain tensor would
    (the stream then sees the clip: Note [Step ledger])."""
    for g, before in sharded:
        if g._version + g._local_tensor._version == before:
            torch.autograd.graph.increment_version(g)
