"""``python -m tierflow COMMAND``: tierflow's command line.

Commands:
  plan      what fits and how fast: the per-block activation plan for a transformer shape, a transformers
            config.json (--model) or a recorded profile, with bytes per tier and the whole step predicted
            (``python -m tierflow plan --help``)
  timeline  one step of a trace drawn: bytes per tier above the lanes
            (``python -m tierflow timeline TRACE -o step.png``; ``--merge TORCH.json -o merged.json``)
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence


def _plan(argv: Sequence[str]) -> int:
    from .plan import plan_command
    return plan_command(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"plan": _plan}
COMMANDS["timeline"] = lambda argv: __import__("tierflow.cli.timeline", fromlist=["_"]).timeline_command(argv)  # one step of a trace drawn (Note [Trace])


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches to a command; returns the exit code (2 for a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"python -m tierflow: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return command(argv[1:])
