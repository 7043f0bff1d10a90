"""Saved activations: the per-block plans and their mechanism (Note [Activation plans] in runner.py).

blocks.py finds a model's repeated blocks; table.py records what a block's forward saves; runner.py carries a
block's plan out (keep, swap, split, recompute); autoplan.py measures the blocks and links, asks the C++ planner
and applies its plan; profile.py keeps the names of the profile file (tiering/profile_file.hpp); meter.py measures what a forward saves;
side_effects.py finds what a block's forward does besides its outputs and restores it around a replay
(Note [Replay side effects] in tiering/replay_rule.hpp)."""

from .side_effects import replay_safe

__all__ = ["replay_safe"]
