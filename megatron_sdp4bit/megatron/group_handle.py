"""An async handle over several collectives, shaped like megatron's, and the clock of
how long megatron's thread waited on such handles."""
from __future__ import annotations

import time
from typing import Optional

WAIT_KINDS = ("reduce_scatter", "all_gather")


class WaitClock:
    """Host seconds the caller of ``Handles.wait`` spent in it, per collective: with
    Megatron's overlap flags that caller is the training thread (``finish_grad_sync``
    before the optimizer step, the forward pre-hooks), so this is the communication
    the overlap left exposed on this rank. Only grows; readers take differences.

    On a thread runner (gloo) the host blocks until the collective is done; on a side
    stream (NCCL) ``wait`` only orders the compute stream after it, so the host time is
    about zero and the device's waiting is the overlap profile's to measure."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(WAIT_KINDS, 0.0)

    def snapshot(self) -> dict:
        return dict(self.seconds)


class Handles:
    """Waits on several collective handles, like the coalescing manager's handle
    megatron keeps, then runs ``on_done`` once. With a ``clock``, the time spent
    waiting (not ``on_done``'s) counts under ``kind``."""

    def __init__(self, handles, on_done=None, clock: Optional[WaitClock] = None, kind: str = ""):
        if clock is not None and kind not in WAIT_KINDS:
            raise ValueError(f"kind={kind!r}; a timed handle is one of {WAIT_KINDS}")
        self.handles = [h for h in handles if h is not None]
        self.on_done = on_done
        self.clock, self.kind = clock, kind

    def wait(self):
        started = time.perf_counter()
        for handle in self.handles:
            handle.wait()
        if self.clock is not None and self.handles:
            self.clock.seconds[self.kind] += time.perf_counter() - started
        self.handles = []
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done()
