"""Hugging Face transformers models: their key/value cache in training (Note [HF caches]).

Note [HF caches]
~~~~~~~~~~~~~~~~
A transformers model with ``config.use_cache=True`` (GPT-2's, Llama's and most
decoders' default) makes a ``DynamicCache`` on every forward, also in training,
and each layer appends its keys and values to it. Under tierflow that is wrong
twice over: a block that is recomputed in backward (every block during
``auto``'s two profiling steps, and the recompute and split plans) is called
again with the same cache object, which its forward grew, so the replay runs
other ops (a ``cat`` onto the old keys) and would attend to twice the keys; and
the cache, which the model's output holds through backward, keeps every layer's
keys and values on the device whatever tierflow offloads. HF's own
``gradient_checkpointing_enable()`` and DeepSpeed turn ``use_cache`` off in
training, with a warning; so does tierflow:

- ``disable_cache_in_training`` (at ``wrap``): every transformers
  ``PreTrainedModel`` in the model whose ``config.use_cache`` is true and whose
  forward takes ``use_cache`` gets a forward pre-hook that passes
  ``use_cache=False`` to a forward in training mode with grad enabled, unless
  the caller passed ``use_cache`` itself. One warning per ``wrap`` says so.
  The config is left alone: ``model.eval()``, ``torch.no_grad()`` and
  ``generate()`` keep the cache.
- ``cache_argument`` (per block forward): a block that will be replayed and is
  called with a transformers ``Cache`` (``use_cache=True`` or
  ``past_key_values=`` passed explicitly in training) is refused with an error
  that names the block, the argument and what to do, before it runs.

Neither imports transformers: a model is one of its models only when
transformers is already imported.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any, Optional

import torch


def _transformers_class(module: str, name: str) -> Optional[type]:
    """transformers' class ``name`` from ``module`` when transformers is already imported, else None."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _use_cache_position(forward: Any) -> Optional[int]:
    """The position of ``use_cache`` among the positional parameters of a bound ``forward``; -1 when it is
    keyword-only; None when the forward takes no ``use_cache``."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache":
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else -1
    return None


def disable_cache_in_training(model: torch.nn.Module) -> list:
    """Training forwards of the transformers models in ``model`` run with ``use_cache=False`` (Note [HF
    caches]); warns once when any had ``config.use_cache`` on. Returns the hooks' handles."""
    pretrained = _transformers_class("transformers.modeling_utils", "PreTrainedModel")
    if pretrained is None:
        return []
    handles, named = [], None
    for module in model.modules():
        if not isinstance(module, pretrained) or not getattr(getattr(module, "config", None), "use_cache", False):
            continue
        position = _use_cache_position(module.forward)
        if position is None:
            continue
        handles.append(module.register_forward_pre_hook(_no_cache_hook(position), with_kwargs=True))
        named = named or type(module).__name__  # the outermost transformers model, not a user's wrapper
    if handles:
        warnings.warn(
            f"tierflow.wrap: {named} has config.use_cache=True; its training forwards run with "
            "use_cache=False, as HF's gradient checkpointing does (a cache in training holds every layer's keys and "
            "values on the device, and a recomputed block would be replayed onto the cache its forward grew). "
            "model.eval(), torch.no_grad() and generate() keep the cache. To silence this, set "
            "model.config.use_cache = False before tierflow.wrap.", UserWarning, stacklevel=3)
    return handles


def _no_cache_hook(position: int) -> Any:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not (module.training and torch.is_grad_enabled()) or "use_cache" in kwargs \
                or 0 <= position < len(args):
            return None  # inference, or the caller chose
        return args, dict(kwargs, use_cache=False)
    return hook


def cache_argument(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """``name=ClassName`` of the first argument of a block's call that is a transformers Cache, else None."""
    cache = _transformers_class("transformers.cache_utils", "Cache")
    if cache is None:
        return None
    for name, value in kwargs.items():
        if isinstance(value, cache):
            return f"{name}={type(value).__name__}"
    for i, value in enumerate(args):
        if isinstance(value, cache):
            try:
                names = [p.name for p in inspect.signature(module.forward).parameters.values()]
                name = names[i] if i < len(names) else f"argument {i}"
            except (TypeError, ValueError):
                name = f"argument {i}"
            return f"{name}={type(value).__name__}"
    return None
