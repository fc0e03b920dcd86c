"""The tests' multi-rank harness (tests only, not installed).

- ``world``: ``spawn_ranks`` starts a world of gloo ranks on 127.0.0.1 (a free
  port, taken ports retried, a deadline instead of a hang; ``start`` picks spawn,
  fork or a forkserver), the one way a test starts several processes.
- ``battery``: many small cases in one world per size (``@battery.case``), each
  case's assertions in the test module that defines it.
- ``tiny_gpt``: inside a rank, a tiny megatron-core GPT trained by megatron's DDP,
  optimizer and schedule, and the single-process reference it is compared with.

Only ``world`` is imported here: ``tiny_gpt`` imports megatron-core, which the
tests of the collectives do not need.
"""
from harness.world import START_METHODS, RankFailed, free_port, spawn_ranks

__all__ = ["RankFailed", "START_METHODS", "free_port", "spawn_ranks"]
