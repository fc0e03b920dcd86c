"""Many small multi-rank cases in one world per size: ``@battery.case(2, 4, 8)``.

Starting a world costs more than most cases in it, so every case registered for a
world size runs in one world of that size, started once per test session (by the
first test that asks for one of its results). A case and the tests that assert on
it live in the same module: the case is a module-level function
``case(rank, world) -> plain data``, and a test reads what every rank returned with
``battery.results(case, world)``.

Every rank runs the cases in the order they were registered (the order pytest
imported their modules), each after ``torch.manual_seed(0)`` and a fresh set of
the collectives' stochastic-rounding streams, so a case sees the same state
whichever cases ran before it. A case that raises fails only the tests that read
it, with its rank's traceback; a case that hangs (a collective some rank did not
reach) fails the world's deadline, and with it every test of that world.
"""
from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Callable, Dict, List, Sequence, Tuple, Union

import pytest

from harness.world import RankFailed, spawn_ranks

Case = Callable[[int, int], object]


def max_test_ranks() -> int:
    """Largest world the suite starts (``SDP4BIT_TEST_MAX_RANKS``, default 8)."""
    return int(os.environ.get("SDP4BIT_TEST_MAX_RANKS", "8"))


@dataclasses.dataclass
class CaseFailed:
    """What a rank returns for a case that raised: its traceback."""

    traceback: str


def case_key(case: Case) -> str:
    return f"{case.__module__}.{case.__qualname__}"


def _run_cases(rank: int, world: int, cases: Sequence[Case]) -> Dict[str, object]:
    """Inside every rank: each case in order, from the same seeds."""
    import torch

    from megatron_sdp4bit.comm import reset_generators

    out: Dict[str, object] = {}
    for case in cases:
        torch.manual_seed(0)
        reset_generators()
        try:
            out[case_key(case)] = case(rank, world)
        except Exception:  # the tests that read this case fail with it
            out[case_key(case)] = CaseFailed(traceback.format_exc())
    return out


class Battery:
    """The registered cases and, once run, each world size's results."""

    def __init__(self, timeout_s: float = 240.0, start: str = "forkserver"):
        self.timeout_s = timeout_s
        self.start = start
        self._cases: Dict[str, Tuple[Case, Tuple[int, ...]]] = {}
        self._worlds: Dict[int, Union[List[dict], Exception]] = {}

    def case(self, *worlds: int) -> Callable[[Case], Case]:
        """Register the decorated ``case(rank, world)`` for worlds of these sizes."""
        if not worlds:
            raise ValueError("name the world sizes the case runs in, e.g. @battery.case(2, 4)")

        def register(case: Case) -> Case:
            self._cases[case_key(case)] = (case, worlds)
            return case
        return register

    def results(self, case: Case, world: int) -> list:
        """What every rank returned for ``case`` in the world of ``world`` ranks, in rank
        order (the world starts on the first call for its size)."""
        if world > max_test_ranks():
            pytest.skip(f"world of {world} ranks exceeds SDP4BIT_TEST_MAX_RANKS={max_test_ranks()}")
        key = case_key(case)
        if key not in self._cases or world not in self._cases[key][1]:
            raise ValueError(f"{key} is not a case of the world of {world} ranks "
                             "(register it with @battery.case(..., world))")
        ran = self._run(world)
        if any(key not in per_rank for per_rank in ran):
            raise RuntimeError(f"{key} was registered after the world of {world} ranks ran")
        values = [per_rank[key] for per_rank in ran]
        for rank, value in enumerate(values):
            if isinstance(value, CaseFailed):
                raise AssertionError(f"{key} failed on rank {rank} of {world}:\n{value.traceback}")
        return values

    def _run(self, world: int) -> List[dict]:
        if world not in self._worlds:
            cases = [case for case, worlds in self._cases.values() if world in worlds]
            try:
                self._worlds[world] = spawn_ranks(_run_cases, world, cases,
                                                  timeout_s=self.timeout_s, start=self.start)
            except (RankFailed, TimeoutError) as exc:  # fail every test of it, start it once
                self._worlds[world] = exc
        outcome = self._worlds[world]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
