"""``Handles`` and its ``WaitClock``: the time megatron's thread spends waiting on the
layer's handles counts under the handle's collective, and only that time."""
from __future__ import annotations

import time

import pytest

from megatron_sdp4bit.megatron.group_handle import Handles, WaitClock


class _Slow:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.waited = seconds, 0

    def wait(self):
        time.sleep(self.seconds)
        self.waited += 1


def test_the_time_blocked_counts_under_the_kind_and_on_done_does_not():
    clock = WaitClock()
    slow = _Slow(0.05)
    handle = Handles([slow, None], on_done=lambda: time.sleep(0.2), clock=clock, kind="all_gather")
    started = time.perf_counter()
    handle.wait()
    elapsed = time.perf_counter() - started
    assert slow.waited == 1
    assert 0.05 <= clock.seconds["all_gather"] < elapsed - 0.15  # on_done's 0.2 s left out
    assert clock.seconds["reduce_scatter"] == 0
    handle.wait()  # a second wait finds nothing left: nothing more counted
    assert clock.seconds["all_gather"] < elapsed - 0.15 and slow.waited == 1


def test_without_a_clock_nothing_is_timed_and_a_bad_kind_is_refused():
    Handles([_Slow(0.0)]).wait()
    with pytest.raises(ValueError, match="kind='grads'"):
        Handles([], clock=WaitClock(), kind="grads")
    assert WaitClock().snapshot() == {"reduce_scatter": 0.0, "all_gather": 0.0}
