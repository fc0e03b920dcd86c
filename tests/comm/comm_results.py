"""Each world size is spawned once per test session; its results are shared by every test."""
from __future__ import annotations

import pytest

import comm_battery
from comm_harness import max_test_ranks, run_world

WORLDS = (2, 4, 8)
_CACHE: dict = {}


def world_results(world: int) -> list:
    """Per-rank result dicts of ``comm_battery.battery`` on ``world`` gloo ranks."""
    if world > max_test_ranks():
        pytest.skip(f"world of {world} ranks exceeds SDP4BIT_TEST_MAX_RANKS={max_test_ranks()}")
    if world not in _CACHE:
        try:
            _CACHE[world] = run_world(comm_battery.battery, world)
        except AssertionError as exc:  # fail every dependent test, but spawn only once
            _CACHE[world] = exc
    if isinstance(_CACHE[world], Exception):
        raise _CACHE[world]
    return _CACHE[world]


def cases(results: list, prefix: str):
    """(rank, key, value) of every case whose key starts with ``prefix``."""
    return [(rank, key, value) for rank, per_rank in enumerate(results)
            for key, value in per_rank.items() if key.startswith(prefix)]
