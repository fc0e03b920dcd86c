"""Fixtures of the multi-rank tests: the world sizes and their (shared) results."""
from __future__ import annotations

import pytest

from comm_battery import STATISTICS_WORLDS
from comm_results import WORLDS, world_results


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request) -> int:
    return request.param


@pytest.fixture
def results(world) -> list:
    return world_results(world)


@pytest.fixture(params=STATISTICS_WORLDS, ids=[f"world{w}" for w in STATISTICS_WORLDS])
def stats_results(request) -> list:
    """Results of the worlds that also ran the statistical cases."""
    return world_results(request.param)
