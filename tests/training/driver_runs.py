"""Test helpers (not a test module): the driver's run with the weights hashed after every
step, and worlds of ranks that run the driver on the embedded corpus.

``run_with_hashes(args, prepare)`` builds the run's parts, lets ``prepare(parts)``
change them (a fault injected into a schedule callback, counters on the model's
bucket groups), trains, and returns the driver's summary plus
``weights_sha256_per_step`` (after each iteration, through the run's per-step
callback) and ``weights_sha256`` (at the end).

``driver_world(tmp_path_factory, name, fn, world_size, *args, timeout_s)`` runs
``fn(rank, world_size, root, *args)`` on gloo ranks (``harness.spawn_ranks``, forked
by default: the ranks inherit the driver's imports, which take most of a rank's
start-up on a busy CPU) in a fresh folder ``root`` whose corpus cache
(``corpus_cache``) every rank reads; it returns ``(root, results)``.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

import pytest

from harness import spawn_ranks
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


@contextlib.contextmanager
def corpus_cache(root: str) -> Iterator[None]:
    """While open: the embedded corpus (1 MiB) prepared once in ``root/cache``, where the
    ranks started inside find it (``SDP4BIT_CACHE``), and one thread per rank; later tests
    see neither."""
    from megatron_sdp4bit.data import prepare_default_corpus

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP4BIT_CACHE", os.path.join(root, "cache"))
        mp.setenv("OMP_NUM_THREADS", "1")
        prepare_default_corpus(max_mb=1)  # once, before the ranks start
        yield


def import_the_driver() -> None:
    """What the driver imports lazily, imported here once (forked ranks inherit it)."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    import megatron_sdp4bit.megatron.cpu  # noqa: F401
    import megatron_sdp4bit.pretrain  # noqa: F401
    from megatron_sdp4bit.training import checkpoint, fusions, metrics, model  # noqa: F401


def driver_ranks(fn: Callable, world_size: int, root: str, *args, timeout_s: float,
                 start: str = "fork") -> list:
    """``fn(rank, world_size, root, *args)`` on ``world_size`` ranks, inside ``corpus_cache``."""
    if start == "fork":
        import_the_driver()
    return spawn_ranks(fn, world_size, root, *args, timeout_s=timeout_s, start=start)


def driver_world(tmp_path_factory, name: str, fn: Callable, world_size: int, *args,
                 timeout_s: float, start: str = "fork") -> tuple:
    """``(root, results)``: a fresh folder ``root``, its corpus, and ``driver_ranks``."""
    root = str(tmp_path_factory.mktemp(name))
    with corpus_cache(root):
        return root, driver_ranks(fn, world_size, root, *args, timeout_s=timeout_s, start=start)
