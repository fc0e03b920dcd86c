"""Test helper (not a test module): the driver's run, with the weights hashed after every step.

``run_with_hashes(args, prepare)`` builds the run's parts, lets ``prepare(parts)``
change them (a fault injected into a schedule callback, counters on the model's
bucket groups), trains, and returns the driver's summary plus
``weights_sha256_per_step`` (after each iteration, through the run's per-step
callback) and ``weights_sha256`` (at the end).
"""
from __future__ import annotations

from typing import Callable, Optional

from megatron_sdp4bit.megatron.consistency import weights_sha256
from megatron_sdp4bit.training.run import TrainingRun
from megatron_sdp4bit.training.setup import RunParts, set_up


def run_with_hashes(args, prepare: Optional[Callable[[RunParts], None]] = None,
                    forward_step: Optional[Callable] = None) -> dict:
    parts = set_up(args)
    if prepare is not None:
        prepare(parts)
    hashes = []
    training = TrainingRun(parts, on_step=lambda run: hashes.append(weights_sha256(run.ddp)),
                           forward_step=forward_step)
    training.train()
    summary = training.summary()
    summary.update(weights_sha256=weights_sha256(training.ddp), weights_sha256_per_step=hashes)
    return summary
