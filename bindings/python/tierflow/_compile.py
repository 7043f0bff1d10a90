"""tierflow's hooks, torch.compile and CUDA graphs (Note [Hooks outside graphs]).

Note [Hooks outside graphs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every hook tierflow puts on a model or a block calls into its runtime (copies,
events, the RNG state, saved-tensor hooks), none of which dynamo can put in a
graph. Traced, each such call broke the graph somewhere inside the hook, and
dynamo captured a handful of fragments a step while saying nothing useful. So
each hook runs eagerly, never traced (torch.compiler.disable): a compiled model
runs as graphs between tierflow's hooks, with the same results as eager, and the
first time a hook is reached from code dynamo is compiling, tierflow warns once
that compile and offload do not mix (a graph break at every hooked module; the
plan's blocks run in separate graphs, or eagerly). What does mix: a plan that
keeps every block leaves no block hook (Note [Activation plans]), and the
model's own hooks are two graph breaks a forward.

CUDA graph capture cannot hold them at all (they wait on events from the host,
read the generator's state and copy to pinned memory), and a captured step would
replay copies into buffers that have since been reused: a hook reached while
the current stream is capturing raises, naming the capture, before it does
anything.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from . import _C

_said = False


@torch.compiler.disable
def _say_once() -> None:
    global _said
    if _said:
        return
    _said = True
    warnings.warn(
        "tierflow: torch.compile and tierflow's offload do not mix: tierflow's hooks (on the model and on each "
        "block it plans) run outside the compiled graphs, so the model compiles as pieces between them, with the "
        "same results as eager but little of the speed; compile the model without tierflow, or train with "
        "tierflow uncompiled (a plan that keeps every block leaves only the model's two hooks)", stacklevel=3)


def outside_graphs(hook: Callable) -> Callable:
    """``hook`` run eagerly, never traced by dynamo; reached while compiling, it warns once first."""
    eager = torch.compiler.disable(hook)

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            _say_once()
        elif capturing():
            raise _C.TierflowError(
                "tierflow: a CUDA graph is being captured (torch.cuda.graph, CUDAGraph.capture_begin, or "
                "torch.compile(mode='reduce-overhead')) through a model tierflow wrapped: its hooks wait on events, "
                "read the generator and copy to pinned memory, which a graph cannot replay; capture a model that is "
                "not wrapped, or train with tierflow without CUDA graphs (torch.compile's default mode)")
        return eager(*args, **kwargs)

    return run


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA in use)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
