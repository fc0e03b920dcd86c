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

    Kept only where that host time means something: on a thread runner (gloo) the host
    blocks until the collective is done. On a side stream (NCCL) ``wait`` only orders
    the compute stream after it and on the inline runner the call ran at submission,
    so there the layer times nothing (``LayerState.wait_clock``) and the device's
    waiting is the overlap profile's to measure. ``waits`` counts the timed waits, so
    a direction nothing was timed for reads as "not measured", not as 0."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(WAIT_KINDS, 0.0)
        self.waits = dict.fromkeys(WAIT_KINDS, 0)

    def snapshot(self) -> dict:
        """``{kind: (seconds, timed waits)}`` so far."""
        return {kind: (self.seconds[kind], self.waits[kind]) for kind in WAIT_KINDS}


def waited_text(reduce_scatter: Optional[float], all_gather: Optional[float], per: str) -> str:
    """`` | waited RS 19 + AG 46 ms/step``: the timed directions only; empty when none."""
    parts = [f"{name} {seconds * 1000:.0f}" for name, seconds in (("RS", reduce_scatter), ("AG", all_gather))
             if seconds is not None]
    return f" | waited {' + '.join(parts)} ms/{per}" if parts else ""


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
            self.clock.waits[self.kind] += 1
        self.handles = []
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done()
