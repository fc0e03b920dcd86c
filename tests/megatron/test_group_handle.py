"""``Handles`` and its ``WaitClock``: the time megatron's thread spends waiting on the
layer's handles counts under the handle's collective, and only that time; the text of
the log lines says only what was timed."""
from __future__ import annotations

import time

import pytest

from megatron_sdp4bit.megatron.group_handle import Handles, WaitClock, waited_text


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
    seconds, waits = clock.snapshot()["all_gather"]
    assert slow.waited == 1 and waits == 1
    assert 0.05 <= seconds < elapsed - 0.15  # on_done's 0.2 s left out
    assert clock.snapshot()["reduce_scatter"] == (0.0, 0)
    handle.wait()  # a second wait finds nothing left: nothing more counted
    assert clock.snapshot()["all_gather"] == (seconds, 1) and slow.waited == 1


def test_without_a_clock_nothing_is_timed_and_a_bad_kind_is_refused():
    Handles([_Slow(0.0)]).wait()
    with pytest.raises(ValueError, match="kind='grads'"):
        Handles([], clock=WaitClock(), kind="grads")
    assert WaitClock().snapshot() == {"reduce_scatter": (0.0, 0), "all_gather": (0.0, 0)}


def test_the_text_names_only_the_directions_that_were_timed():
    assert waited_text(0.0191, 0.046, "step") == " | waited RS 19 + AG 46 ms/step"
    assert waited_text(0.0191, None, "iter") == " | waited RS 19 ms/iter"  # gathers not overlapped
    assert waited_text(None, None, "step") == ""  # nothing overlapped on a worker thread
