"""state_dict() and load_state_dict() of a model whose parameters live off the device between uses
(Note [Parameter hooks], "Everything else").

Note [Parameter state]
~~~~~~~~~~~~~~~~~~~~~~
state_dict() holds each offloaded parameter's value on the host (a CPU tensor); load_state_dict() fetches each
module's parameters, lets the module load them and writes them back.
"""

from __future__ import annotations

from typing import Any

import torch


def state_hooks(model: torch.nn.Module, me: Any) -> list:
    """The state_dict and load_state_dict hooks of every module of ``model`` holding parameters; ``me``: a weak
    reference to its ParamOffload."""
    handles = []

    def saving(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        offload = me()
        if offload is None:
            return
        for name, p in module.named_parameters(recurse=False):
            if prefix + name in state_dict and offload.impl.offloaded(p):
                state_dict[prefix + name] = offload.impl.load(p).detach()

    def loading(module: torch.nn.Module, *args: Any) -> None:
        offload = me()
        if offload is not None:
            for p in module.parameters(recurse=False):
                offload.impl.materialize(p, True)

    def loaded(module: torch.nn.Module, incompatible: Any) -> None:
        offload = me()
        if offload is not None:
            for p in module.parameters(recurse=False):
                offload.impl.materialize(p, False)

    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            handles.append(module._register_state_dict_hook(saving))
            handles.append(module.register_load_state_dict_pre_hook(loading))
            handles.append(module.register_load_state_dict_post_hook(loaded))
    return handles
