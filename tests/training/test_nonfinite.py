"""Non-finite gradients: skipped on every rank alike, counted, and a stop when they persist.

One element of rank 1's gradient buffer is set to NaN just before the gradient
reduce-scatter (TLq-HS over 2 emulated nodes x 2). The quantizer must keep it
non-finite through both hops (a NaN quantized into finite numbers would go
unnoticed and corrupt the weights), so megatron's optimizer finds it on the rank
that owns it, the check is all-reduced, and every rank skips the step.
"""
from __future__ import annotations

import math
import os

import pytest

from megatron_harness import spawn_ranks
from megatron_sdp4bit.training.metrics import read_metrics

COMMON = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--bf16",
    "--eval-interval", "1000", "--eval-iters", "1", "--default-corpus-mb", "1",
    "--split", "90,10,0", "--no-progress-bar",
    "--sdp4bit", "--sdp4bit-ranks-per-node", "2",
]
POISONED_RANK, POISONED_ELEMENT = 1, 7


def _poison_gradients_at(rank: int, iterations: set) -> None:
    """Make the driver's schedule hooks put a NaN into this rank's gradient buffer
    before the gradient sync of the given iterations (counted from 1)."""
    import megatron_sdp4bit.pretrain as driver

    wire = driver.wire_schedule_hooks

    def wire_and_poison(ddp, optimizer):
        wire(ddp, optimizer)
        finalize = ddp.config.finalize_model_grads_func
        calls = [0]

        def finalize_with_nan(*args, **kwargs):
            calls[0] += 1
            if rank == POISONED_RANK and calls[0] in iterations:
                ddp.buffers[0].grad_data[POISONED_ELEMENT] = float("nan")
            return finalize(*args, **kwargs)

        ddp.config.finalize_model_grads_func = finalize_with_nan

    driver.wire_schedule_hooks = wire_and_poison


def _nonfinite_world(rank, world_size, root):
    from megatron_sdp4bit.pretrain import NonFiniteTraining, run
    from megatron_sdp4bit.training.arguments import parse_args

    _poison_gradients_at(rank, {3, 4})
    recovered = run(parse_args(COMMON + [
        "--train-iters", "8", "--log-interval", "4", "--run-dir", os.path.join(root, "recovered")]),
        with_weights_hash=True)

    _poison_gradients_at(rank, set(range(3, 100)))  # wraps the hook again: iterations 3.. poisoned
    ckpt = os.path.join(root, "ckpt")
    try:
        run(parse_args(COMMON + [
            "--train-iters", "10", "--log-interval", "5", "--max-consecutive-skipped-iters", "3",
            "--save", ckpt, "--save-interval", "2", "--run-dir", os.path.join(root, "diverged")]))
        stopped = None
    except NonFiniteTraining as exc:
        stopped = str(exc)
    return {"recovered": recovered, "stopped": stopped}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nonfinite"))
    from megatron_sdp4bit.data import prepare_default_corpus

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP4BIT_CACHE", os.path.join(root, "cache"))
        prepare_default_corpus(max_mb=1)
        results = spawn_ranks(_nonfinite_world, 4, root, timeout_s=900)
    return root, results


def _train_records(root, name):
    return [r for r in read_metrics(os.path.join(root, name, "metrics.jsonl")) if r["kind"] == "train"]


def test_a_nan_on_one_rank_skips_the_step_on_every_rank_and_training_goes_on(runs):
    root, results = runs
    records = _train_records(root, "recovered")
    assert [r["skipped"] for r in records] == [2, 0]  # iterations 3 and 4, counted in their window
    assert all(math.isfinite(r["loss"]) for r in records)
    assert len({r["recovered"]["weights_sha256"] for r in results}) == 1
    assert math.isfinite(results[0]["recovered"]["final_train_loss"])


def test_persistent_nans_stop_the_run_naming_the_iteration_without_saving(runs):
    root, results = runs
    for result in results:  # every rank stops, at the same iteration
        assert result["stopped"] is not None
        assert result["stopped"].startswith("iteration 5: the loss or the gradients were not finite")
        assert "3 consecutive iterations (3-5)" in result["stopped"]
    records = _train_records(root, "diverged")
    assert records[-1]["iteration"] == 5 and records[-1]["skipped"] == 3
    latest = open(os.path.join(root, "ckpt", "latest_checkpointed_iteration.txt")).read().strip()
    assert latest == "2"  # no save while steps are being skipped (4), none at the stop (5)
