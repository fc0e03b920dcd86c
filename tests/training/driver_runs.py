"""Test helpers (not a test module): the driver's run with the weights hashed after every
step, and worlds of forked ranks.

``run_with_hashes(args, prepare)`` builds the run's parts, lets ``prepare(parts)``
change them (a fault injected into a schedule callback, counters on the model's
bucket groups), trains, and returns the driver's summary plus
``weights_sha256_per_step`` (after each iteration, through the run's per-step
callback) and ``weights_sha256`` (at the end).

``forked_ranks`` is ``spawn_ranks`` with forked processes: the ranks inherit the
test process's imports (megatron-core takes most of a rank's start-up on a busy CPU).
"""
from __future__ import annotations

import multiprocessing
from types import SimpleNamespace
from typing import Callable, Optional

import pytest

import megatron_harness
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


def forked_ranks(fn, world_size, *args, timeout_s):
    with pytest.MonkeyPatch.context() as mp:
        if "fork" in multiprocessing.get_all_start_methods():
            mp.setattr(megatron_harness, "multiprocessing",
                       SimpleNamespace(get_context=lambda _kind: multiprocessing.get_context("fork")))
        return megatron_harness.spawn_ranks(fn, world_size, *args, timeout_s=timeout_s)
