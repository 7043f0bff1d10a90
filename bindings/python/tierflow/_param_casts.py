"""The 16-bit casts autocast makes of offloaded fp32 parameters (TIERFLOW_OFFLOAD_PARAMS=host|nvme under
torch.autocast; issue 38, item 2).

Note [Parameter casts]
~~~~~~~~~~~~~~~~~~~~~~
Under autocast a matmul of an fp32 weight runs on a 16-bit cast of it (aten::_to_copy). Two things keep such
a cast, a copy of the weight in the device's memory, long after tierflow released the weight itself (Note
[Parameter hooks]):

- autocast's weight-cast cache (cache_enabled=True, the default) keeps the cast of every leaf that requires
  grad until the outermost autocast region exits: every weight of the model at the forward's end. The cast
  stays in the cache, but its memory goes with its unit's use: when a forward use ends, each weight of the
  unit that the use cast (params.py finds autocast's ToCopyBackward0 into the weight's AccumulateGrad among
  the nodes the call made) or whose cast came back at the use's beginning has its cached cast's memory
  dropped (forward_use_ended: the tensor stays in the cache; reading it raises an error naming the weight's
  shape), and when a use of the unit begins again while the cast lives (its region's cache holds it: a weak
  reference tells) the cast gets memory and the weight's values back (forward_use_begins: the cast again,
  into the same tensor, whose version does not move). tierflow never makes a cast itself, so every cast and
  its ToCopyBackward0 are made where autocast makes them: every use in one region shares one cast, as
  without tierflow, and the engine runs its gradient in the same order. A weight used in two forwards under
  one autocast (two passes before one backward, a block called twice, a tied embedding and head) has its
  uses' 16-bit gradients summed before the one conversion, bit for bit cache_enabled=True. A use that builds
  no graph (no_grad: evaluation, generation, a block under no_grad inside a forward) casts without the
  cache (params.py turns it off for the use and back after: the same values, and no gradient reads them),
  which leaves the cache and every cast in it as it is; tierflow never empties the cache (another model's
  or module's casts, waiting for a backward, are in it). A weight read outside its units' uses (params.py
  serves the read: Note [Parameter hooks]) gets its cast's memory back until the region ends (read).
- autograd saves the cast for backward (mm saves its 16-bit weight to compute the gradient of its input):
  with the cache off, and with it on (the cache's reference goes with the use, autograd's stays), every
  weight's cast would stay on the device from its forward to its backward. Every saved-tensor hook tierflow
  installs (the model's in _wrap.py, the block runners' in activations/runner.py) asks saved_cast() first:
  a saved tensor that is a cast of an offloaded parameter, or a view of one (its base's grad_fn is
  ToCopyBackward0 whose input is the parameter's AccumulateGrad), is saved as a recipe (the parameter, the
  dtype, the cast's layout, the view's) and cast again when backward unpacks it, when the parameter is on
  the device again: its unit's backward use is open while autograd computes the gradients that read it.
  The same op on the same values: bit for bit the cast it replaces. The parameter's version is kept with the
  recipe; a parameter written in place between the forward and the backward (which autocast's saved cast
  would not have seen) is refused, naming it, rather than re-cast from the new values.
- A frozen parameter (requires_grad=False: LoRA's base weights) is cast without a graph (and never cached):
  nothing tells its saved cast from any other tensor, so it is an ordinary saved activation. The activation
  modes move it like one (host, nvme and the plans' swap copy it off the device; recompute and split cast it
  again in the replay); with TIERFLOW_OFFLOAD_ACTIVATIONS=none it stays on the device until its backward.
  Keep frozen base weights in the 16-bit dtype autocast runs them in (as PEFT loads them) to have no cast.

What remains on the device: the casts of the unit in use (at most its weights in 16 bits, half its fp32
bytes; measured on a 16-block GPT-2: 395,520 bytes at most during the forward, none at its end, where
6,352,896 bytes, every weight's cast, were alive before) and, in backward, the cast a gradient is being
computed from. They are not counted in TIERFLOW_GPU_MEMORY's parameter budget (the schedule counts the fp32
parameters). The report says under params.casts (stats()): saved_as_recipes and recast_bytes, the casts
saved as recipes and the bytes cast again in backward; use_peak_bytes, the largest sum of distinct casts
saved for backward within one forward use (what autocast's cache held then; a block under recompute or
split saves none, its casts are made again by its replay).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from . import _C

# The ParamOffload of each live session (Session.attach registers it): whose parameters are offloaded.
_offloads: "weakref.WeakSet[Any]" = weakref.WeakSet()
_stats: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_use: dict = {}  # id(parameter) -> bytes of its cast, saved during the forward use in progress
# id(parameter) -> weak references to it and to its cast in autocast's cache, whose memory went with its use (weak:
# the cache holds the cast while its region lives, and the cast's graph holds the parameter)
_dropped: dict = {}


def watch(offload: Any) -> None:
    """Recognises casts of ``offload``'s parameters from now on (Session.attach)."""
    _offloads.add(offload)
    _stats[offload] = {"saved_as_recipes": 0, "recast_bytes": 0, "use_peak_bytes": 0}


def stats(offload: Any) -> dict:
    """What the report says under params.casts (Note [Parameter casts])."""
    return dict(_stats.get(offload, {}))


def _caching(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled()


def forward_use_begins(params: list, device_type: str) -> list:
    """A forward use of a unit with these fp32 weights begins (params.py): their cached casts, whose memory went
    with their last use in this autocast region, get it back with their values (Note [Parameter casts]).
    Returns (weight, cast) of those. A cast that died went with its region: the use casts anew, as autocast."""
    if not _dropped or not _caching(device_type):
        return []
    return [(p, cast) for p in params if (cast := _refill(p, True)) is not None]


def forward_use_ended(refilled: list, cast: Optional[list], device_type: str) -> None:
    """A forward use of a unit ended (params.py). ``refilled``: what forward_use_begins gave back; ``cast``: the
    unit's fp32 weights autocast cast in the use (the nodes the call made), or None for a use that built no graph
    (which cast without the cache: params.py turns it off for such a use). Their cached casts' memory goes with
    the use, their tensors stay in autocast's cache (Note [Parameter casts])."""
    _use.clear()
    if not _caching(device_type):
        return
    dtype = torch.get_autocast_dtype(device_type)
    done = set()
    for p, c in refilled:
        _drop(p, c, dtype)
        done.add(id(p))
    for p in cast or ():
        if id(p) not in done:
            done.add(id(p))
            _drop(p, _C._autocast_cached_cast(p, dtype, device_type), dtype)  # made in the use: cached


def read(p: torch.Tensor, device_type: str) -> None:
    """``p`` is read outside its units' uses (params.py serves the read): its cast in autocast's cache, if its
    memory went, gets it back, and keeps it until the region ends (Note [Parameter casts])."""
    if _dropped:
        _refill(p, _caching(device_type))


def _refill(p: torch.Tensor, caching: bool) -> Optional[torch.Tensor]:
    """p's cast whose memory went with its use, taken off the dropped ones: its memory and p's values back when
    autocast's cache still holds it (``caching``). None when it has none (or it died with its region)."""
    entry = _dropped.pop(id(p), None)
    cast = entry[1]() if entry is not None and entry[0]() is p else None
    if cast is not None and caching:
        _C._refill_cast(cast, p)
    return cast


def _drop(p: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> None:
    if c.dtype != dtype:
        return
    _C._drop_cast(c, f"tierflow: the {dtype} cast autocast keeps of an offloaded parameter of shape "
                     f"{list(p.shape)} was read outside its unit's use (Note [Parameter casts]); read "
                     "parameters inside the modules that hold them, or use offload_params='none'")
    _dropped[id(p)] = (weakref.ref(p), weakref.ref(c))


def resident(params: list, device_type: str) -> None:
    """These weights stay on the device from now on (TIERFLOW_OFFLOAD_PARAMS=auto's plan): their casts whose
    memory went get it back now when this autocast region still caches them, and are autocast's alone again."""
    for p in params:
        _refill(p, _caching(device_type))


def forget() -> None:
    """unwrap: no cast of an offloaded weight is dropped any more (those dropped go with their region)."""
    _dropped.clear()


class SavedCast:
    """What autograd holds for a saved cast of an offloaded parameter: how to make it again."""

    __slots__ = ("param", "dtype", "cast_size", "cast_stride", "size", "stride", "offset", "version", "offload")

    def __init__(self, param: torch.Tensor, cast: torch.Tensor, t: torch.Tensor, offload: Any) -> None:
        self.param = param
        self.dtype = cast.dtype
        self.cast_size, self.cast_stride = cast.size(), cast.stride()
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = param._version
        self.offload = weakref.ref(offload)

    def _name(self) -> str:
        model_ref = getattr(self.offload(), "_model", None)
        model = model_ref() if model_ref is not None else None
        return next((n for n, q in model.named_parameters() if q is self.param), "?") if model is not None else "?"

    def _on_device(self) -> bool:
        """False when the parameter is offloaded and released now (made resident since the forward: on the
        device)."""
        impl = getattr(self.offload(), "impl", None)
        return impl is None or not impl.offloaded(self.param) or impl.on_device(self.param)

    def materialize(self) -> torch.Tensor:
        """The cast again, from the parameter on the device (its unit's backward use is open)."""
        p = self.param
        if not self._on_device():
            raise _C.TierflowError(
                f"tierflow: parameter '{self._name()}' {list(p.shape)} is not on the device when backward reads its "
                f"cast to {self.dtype} (autocast; Note [Parameter casts]): its unit's backward use has ended; read "
                "it only inside the module that holds it, or use offload_params='none'")
        if p._version != self.version:
            raise _C.TierflowError(
                f"tierflow: parameter '{self._name()}' {list(p.shape)} was written in place between the forward "
                f"that cast it to {self.dtype} (autocast) and the backward that reads the cast; with offloaded "
                "parameters the cast is made again in backward from the parameter (Note [Parameter casts]), so it "
                "would not be the forward's. Update parameters after backward (optimizer.step() after "
                "loss.backward()), or use offload_params='none'")
        with torch.no_grad():
            # aten::_to_copy is empty_strided in the source's layout then copy_: the same bits.
            cast = torch.empty_strided(self.cast_size, self.cast_stride, dtype=self.dtype, device=p.device)
            cast.copy_(p)
        stats = _stats.get(self.offload())
        if stats is not None:
            stats["recast_bytes"] += cast.untyped_storage().nbytes()
        if self.size == self.cast_size and self.stride == self.cast_stride and self.offset == 0:
            return cast
        return cast.as_strided(self.size, self.stride, self.offset)


def saved_cast(t: torch.Tensor) -> Optional[SavedCast]:
    """A recipe for ``t`` when it is a cast of an offloaded parameter or a view of one, else None (Note
    [Parameter casts])."""
    if not _offloads or not t.requires_grad or t.is_leaf:
        return None
    cast = t._base if t._is_view() else t
    fn = cast.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return None
    acc = fn.next_functions[0][0]
    p = getattr(acc, "variable", None)  # AccumulateGrad's parameter
    if p is None or p.dtype == cast.dtype or p.device != cast.device or p.shape != cast.shape:
        return None
    if cast.storage_offset() != 0 or cast.untyped_storage().nbytes() != cast.numel() * cast.element_size():
        return None  # not a dense cast: made again, it might not lie where the view expects it
    offload = next((o for o in list(_offloads) if o.offloaded(p)), None)
    if offload is None:
        return None
    s = _stats.get(offload)
    if s is not None:
        s["saved_as_recipes"] += 1
        if id(p) not in _use:
            _use[id(p)] = cast.numel() * cast.element_size()
            s["use_peak_bytes"] = max(s["use_peak_bytes"], sum(_use.values()))
    return SavedCast(p, cast, t, offload)


def around(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> tuple:
    """Saved-tensor hooks that save casts of offloaded parameters as recipes and hand the rest to ``pack`` /
    ``unpack``."""
    def pack_or_recipe(t: torch.Tensor) -> Any:
        r = saved_cast(t)
        return r if r is not None else pack(t)

    def unpack_or_cast(saved: Any) -> torch.Tensor:
        return saved.materialize() if type(saved) is SavedCast else unpack(saved)

    return pack_or_recipe, unpack_or_cast
