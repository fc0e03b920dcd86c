"""What the driver measures between two log lines: the wire bytes and the training window.

Beside ``metrics.py``, which writes the figures out; nothing here prints.
"""
from __future__ import annotations

import time

import torch

from megatron_sdp4bit.megatron import patch


class WireMeter:
    """Bytes this rank sent vs what the exact collectives would have sent, per level.

    The patch layer is installed on every run (with quantization off it defers to
    megatron's own collectives and only counts their bytes), so the exact
    baseline run and the SDP4Bit run are measured the same way. The layer's counters
    only grow; a window is the difference of two snapshots, so other readers
    (a test's, a script's) see the same bytes.
    """

    def __init__(self):
        self.totals = {"sent": 0, "exact": 0, "sent_intra": 0, "sent_inter": 0}
        self._seen = patch.wire_stats()

    def read(self) -> dict:
        """The bytes since the last read, or since the meter was made (added to ``totals``)."""
        now = patch.wire_stats()
        stats, self._seen = now.since(self._seen), now
        window = {"sent": stats.sent_bytes(), "exact": stats.exact_bytes(),
                  "sent_intra": stats.sent_bytes(level="intra"),
                  "sent_inter": stats.sent_bytes(level="inter")}
        for key, value in window.items():
            self.totals[key] += value
        return window


class WaitMeter:
    """Seconds this rank's training thread waited on the layer's overlapped collectives
    (``patch.collective_waits``) since the last read: with Megatron's overlap flags, the
    communication left exposed, per collective; None for a collective no wait was timed
    for (not overlapped, or not on gloo's worker thread). Windows of growing counters,
    as ``WireMeter``."""

    def __init__(self):
        self._seen = patch.collective_waits()

    def read(self) -> dict:
        now, seen = patch.collective_waits(), self._seen
        self._seen = now
        return {kind: (seconds - seen[kind][0] if waits > seen[kind][1] else None)
                for kind, (seconds, waits) in now.items()}


class TrainingWindow:
    """Loss, step count, skipped steps and wall time of the steps since the last log.

    Nothing here reads a device value per step: the losses are summed on the
    device, and the time is taken from the window's start to ``close()``, which
    waits for the device first (on a GPU, timing one step on the host would
    measure how fast kernels are queued, not how fast they run).
    """

    def __init__(self, device: str):
        self.device = device
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.steps = 0
        self.skipped = 0
        self.started = time.perf_counter()
        self.paused_at = self.started

    def start(self) -> None:
        self.loss_sum.zero_()
        self.steps = self.skipped = 0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, ok: bool) -> None:
        if ok:  # as Megatron-LM: a skipped step's loss (often Inf/NaN) is not averaged in
            self.loss_sum += loss
        self.steps += 1
        self.skipped += not ok

    def _now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def pause(self) -> None:
        """Stop the clock (evaluation and checkpoints are not training time)."""
        self.paused_at = self._now()

    def resume(self) -> None:
        self.started += time.perf_counter() - self.paused_at

    def close(self) -> tuple:
        """(loss sum over the steps not skipped, steps, skipped steps, seconds) of the
        window; then empty."""
        elapsed = self._now() - self.started
        result = (self.loss_sum.item(), self.steps, self.skipped, elapsed)
        self.steps = 0
        return result
