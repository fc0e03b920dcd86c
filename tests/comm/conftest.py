"""Fixtures of the multi-rank tests: the world sizes of the shared worlds (comm_worlds)."""
from __future__ import annotations

import pytest

from comm_worlds import STATISTICS_WORLDS, WORLDS


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request) -> int:
    return request.param


@pytest.fixture(params=STATISTICS_WORLDS, ids=[f"world{w}" for w in STATISTICS_WORLDS])
def stats_world(request) -> int:
    """The worlds that also run the statistical cases."""
    return request.param
