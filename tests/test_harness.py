"""The multi-rank harness itself (tests/harness): every start method joins a real gloo
world, a taken port is retried, a failing case fails only the tests that read it.

(A failing rank's traceback and the deadline instead of a hang are checked in
tests/cpu_backend/test_cpu_backend.py.)
"""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch

import harness.world
from harness import START_METHODS, RankFailed, spawn_ranks
from harness.battery import Battery

pytestmark = pytest.mark.slow  # real gloo processes


def _sum_of_ranks(rank: int, world_size: int, offset: int) -> tuple:
    total = torch.tensor([float(rank + offset)])
    torch.distributed.all_reduce(total)
    return rank, world_size, float(total)


@pytest.mark.parametrize("start", START_METHODS)
def test_every_start_method_joins_one_gloo_world(start):
    results = spawn_ranks(_sum_of_ranks, 3, 10, timeout_s=120, start=start)
    assert results == [(rank, 3, 33.0) for rank in range(3)]


def test_a_port_taken_before_the_rendezvous_is_retried_on_a_new_one(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real, handed_out = harness.world.free_port, []

    def taken_first():
        ports.append(real())
        handed_out.append(ports.pop(0))
        return handed_out[-1]

    monkeypatch.setattr(harness.world, "free_port", taken_first)
    try:
        assert spawn_ranks(_sum_of_ranks, 2, 0, timeout_s=60, start="fork") == [
            (0, 2, 1.0), (1, 2, 1.0)]
        assert len(handed_out) == 2 and handed_out[0] == taken.getsockname()[1]
    finally:
        taken.close()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure")
    return rank


def test_a_forked_rank_that_raises_is_reported_with_its_traceback():
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2 failed.*deliberate failure"):
        spawn_ranks(_fail_on_rank_one, 2, timeout_s=60, start="fork")


def _gone(pid: int) -> bool:
    """Whether the process has exited (a zombie its parent has not reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _late_rank_one_fails(rank: int, world_size: int) -> int:
    """Rank 0 finishes at once; rank 1 is slow: it still talks to the store rank 0
    hosts (as a rank still inside ``init_process_group`` does) after rank 0 is done,
    then fails on purpose."""
    store = torch.distributed.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("rank 0 pid", str(os.getpid()))
        return rank
    rank0 = int(store.get("rank 0 pid"))
    deadline = time.monotonic() + 5  # a harness whose ranks leave alone lets rank 0 go in ms
    while time.monotonic() < deadline and not _gone(rank0):
        time.sleep(0.05)
    store.get("rank 0 pid")  # rank 0 still hosts the store
    raise ValueError("deliberate failure")


def test_a_rank_that_finished_stays_until_every_rank_has(tmp_path):
    """The ranks leave together: a rank that finished first (rank 0, which hosts the
    rendezvous store) waits for the others, so a slow rank meets its own error, not
    "Connection closed by peer" (the flaky harness test of issue 28, made certain)."""
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2 failed.*deliberate failure"):
        spawn_ranks(_late_rank_one_fails, 2, timeout_s=60, start="fork")


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="start must be one of"):
        spawn_ranks(_sum_of_ranks, 2, 0, start="thread")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        spawn_ranks(_sum_of_ranks, 0, 0)


BATTERY = Battery(timeout_s=120, start="fork")


@BATTERY.case(2)
def rank_and_world(rank: int, world: int) -> tuple:
    return rank, world, float(torch.rand(1))  # the seed is reset before every case


@BATTERY.case(2)
def broken_case(rank: int, world: int) -> None:
    raise RuntimeError("a case that raises")


@BATTERY.case(2)
def after_the_broken_one(rank: int, world: int) -> float:
    return float(torch.rand(1))


def test_a_battery_runs_its_cases_in_one_world_and_contains_a_failing_case():
    first = BATTERY.results(rank_and_world, 2)
    assert [r[:2] for r in first] == [(0, 2), (1, 2)]
    with pytest.raises(AssertionError, match="(?s)broken_case failed on rank 0 of 2.*a case that raises"):
        BATTERY.results(broken_case, 2)
    # the cases after it ran, from the same seed as every case
    assert BATTERY.results(after_the_broken_one, 2) == [r[2] for r in first]
    with pytest.raises(ValueError, match="not a case of the world of 4 ranks"):
        BATTERY.results(rank_and_world, 4)
