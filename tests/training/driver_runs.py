"""Test helpers (not a test module): the driver's run with the weights hashed after every
step, and worlds of ranks that run the driver on the embedded corpus.

``run_with_hashes(args, prepare)`` builds the run's parts, lets ``prepare(parts)``
change them (a fault injected into a schedule callback, counters on the model's
bucket groups), trains, and returns the driver's summary plus
``weights_sha256_per_step`` (after each iteration, through the run's per-step
callback, once the step's overlapped weight gathers are done) and ``weights_sha256`` (at the end).

``captured_run(argv, on_step, errors, named)``: the driver's ``run`` on ``argv`` with
its printout captured; one of ``errors`` becomes the result's ``error`` line, so a
world of ranks returns each rank's refusal for the test to compare.

``refusal(call, *errors)``: the message of the refusal ``call()`` raised, or None.

``count_collectives_per_chunk(counts)``: a ``prepare`` that counts, per DDP chunk, the
bucket groups' collectives that went quantized or exact (the experts' apart).

``TINY_GPT``: the driver flags of the tests' model. ``train_records(root, name)`` / ``train_log(root, name, field)``: the training log
lines of the run written to ``root/name`` (its ``--run-dir``).

``driver_world(tmp_path_factory, name, fn, world_size, *args, timeout_s)`` runs
``fn(rank, world_size, root, *args)`` on gloo ranks (``harness.spawn_ranks``, forked
by default: the ranks inherit the driver's imports, which take most of a rank's
start-up on a busy CPU) in a fresh folder ``root`` whose corpus cache
(``corpus_cache``) every rank reads; it returns ``(root, results)``.
"""
from __future__ import annotations

import contextlib
import io
import os
from collections import defaultdict
from typing import Callable, Iterator, Optional

import pytest

from harness import spawn_ranks
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.consistency import weights_sha256
from megatron_sdp4bit.pretrain import run
from megatron_sdp4bit.training.arguments import parse_args
from megatron_sdp4bit.training.checkpoint import CheckpointError
from megatron_sdp4bit.training.metrics import read_metrics
from megatron_sdp4bit.training.run import TrainingRun
from megatron_sdp4bit.training.setup import RunParts, set_up


TINY_GPT = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-warmup-iters", "1",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--default-corpus-mb", "1", "--split", "90,10,0", "--no-progress-bar",
]
"""The driver tests' model: a 1-layer, 32-wide GPT on 1 MiB of the embedded corpus,
every step logged, no evaluation; each test adds its schedule and presets."""


def run_with_hashes(args, prepare: Optional[Callable[[RunParts], None]] = None,
                    forward_step: Optional[Callable] = None) -> dict:
    parts = set_up(args)
    if prepare is not None:
        prepare(parts)
    hashes = []

    def hash_weights(run) -> None:
        patch.drain()  # with --overlap-param-gather the step's weight gathers are still running
        hashes.append(weights_sha256(run.ddp))

    training = TrainingRun(parts, on_step=hash_weights, forward_step=forward_step)
    training.train()
    summary = training.summary()
    summary.update(weights_sha256=weights_sha256(training.ddp), weights_sha256_per_step=hashes)
    return summary


def count_collectives_per_chunk(counts: dict) -> Callable[[RunParts], None]:
    """A ``prepare(parts)`` that makes every bucket group of every DDP chunk report into
    ``counts``, per call, whether the collective it ran sent 4/8-bit codes (quantized)
    or plain values (exact), read from the wire accounting around the call; expert
    bucket groups (MoE) count under ``expert ...`` keys. Only for runs whose
    collectives finish within the call (no overlap flags): an overlapped one counts
    its bytes on the layer's worker, after the call has returned."""
    from megatron_sdp4bit.megatron import patch

    def counted(method, chunk_counts, collective, kind):
        def wrapper(*args, **kwargs):
            before = patch.wire_stats()
            result = method(*args, **kwargs)
            after = patch.wire_stats()
            codes = after.sent_bytes(collective, kind="codes") - before.sent_bytes(collective, kind="codes")
            values = after.sent_bytes(collective, kind="values") - before.sent_bytes(collective, kind="values")
            if codes > 0:
                chunk_counts[f"{kind}{collective} quantized"] += 1
            elif values > 0:
                chunk_counts[f"{kind}{collective} exact"] += 1
            return result
        return wrapper

    def prepare(parts):
        counts.clear()
        for index, chunk in enumerate(parts.model):
            chunk_counts = counts.setdefault(index, defaultdict(int))
            for kind, groups in (("", chunk.bucket_groups),
                                 ("expert ", getattr(chunk, "expert_parallel_bucket_groups", []))):
                for bucket_group in groups:
                    # Instance attributes: megatron calls them as bucket_group.start_*_sync().
                    bucket_group.start_grad_sync = counted(
                        bucket_group.start_grad_sync, chunk_counts, "reduce_scatter", kind)
                    bucket_group.start_param_sync = counted(
                        bucket_group.start_param_sync, chunk_counts, "all_gather", kind)
                chunk_counts[f"{kind}bucket groups"] = len(groups)

    return prepare


def refusal(call: Callable[[], object], *errors: type) -> Optional[str]:
    """The message of the one of ``errors`` that ``call()`` raised; None if it ran."""
    try:
        call()
    except errors as error:
        return str(error)
    return None


def captured_run(argv: list, on_step: Optional[Callable] = None, errors=(CheckpointError,),
                 named: bool = False) -> dict:
    """``{"stdout", "error", "summary"}`` of the driver's ``run`` on ``argv``: ``error`` is
    None, or the message of one of ``errors`` it raised (``"TypeName: message"`` with
    ``named``), and then ``summary`` is None; any other exception propagates."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            summary, error = run(parse_args(argv), on_step=on_step), None
        except errors as exc:
            summary, error = None, f"{type(exc).__name__}: {exc}" if named else str(exc)
    return {"stdout": text.getvalue(), "error": error, "summary": summary}


def train_records(root, name: str) -> list:
    """The training log lines (``kind == "train"``) of the run in ``root/name``."""
    path = os.path.join(os.fspath(root), name, "metrics.jsonl")
    return [r for r in read_metrics(path) if r["kind"] == "train"]


def train_log(root, name: str, field: str = "loss") -> dict:
    """``{iteration: field}`` of the run in ``root/name``'s training log lines."""
    return {r["iteration"]: r[field] for r in train_records(root, name)}


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

    import megatron_sdp4bit.cpu_backend  # noqa: F401
    from megatron_sdp4bit.training import checkpoint, fusions, metrics, model  # noqa: F401


def _as_torchrun_sets_it(rank: int, world_size: int, root: str, fn: Callable, *args):
    """``fn`` in a rank whose environment is torchrun's on one host: the driver reads
    RANK..LOCAL_WORLD_SIZE (without them it takes itself for a single process, whose
    LOCAL_WORLD_SIZE=1 the layer would find contradicted by the hosts)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    return fn(rank, world_size, root, *args)


def driver_ranks(fn: Callable, world_size: int, root: str, *args, timeout_s: float,
                 start: str = "fork") -> list:
    """``fn(rank, world_size, root, *args)`` on ``world_size`` ranks of one host, as torchrun
    starts them, inside ``corpus_cache``."""
    if start == "fork":
        import_the_driver()
    return spawn_ranks(_as_torchrun_sets_it, world_size, root, fn, *args, timeout_s=timeout_s, start=start)


def driver_world(tmp_path_factory, name: str, fn: Callable, world_size: int, *args,
                 timeout_s: float, start: str = "fork") -> tuple:
    """``(root, results)``: a fresh folder ``root``, its corpus, and ``driver_ranks``."""
    root = str(tmp_path_factory.mktemp(name))
    with corpus_cache(root):
        return root, driver_ranks(fn, world_size, root, *args, timeout_s=timeout_s, start=start)
