"""The pre-training driver on 4 gloo ranks (2 emulated nodes x 2), real megatron path.

One spawned world runs, one after another: an exact run, an SDP4Bit run, and an
SDP4Bit run split in two halves by a checkpoint; the tests read its results.
Data: the embedded corpus capped at 1 MiB in a temporary cache.
"""
from __future__ import annotations

import os

import pytest

from driver_runs import driver_world, train_log
from megatron_sdp4bit.training.metrics import TRAIN_FIELDS, read_metrics

STEPS = 20
COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "3e-3", "--use-distributed-optimizer", "--lr-decay-iters", str(STEPS), "--lr-warmup-iters", "2",
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--bf16",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--default-corpus-mb", "1", "--split", "90,10,0", "--no-progress-bar",
]
SDP = ["--sdp4bit", "--sdp4bit-ranks-per-node", "2"]


def _driver_world(rank, world_size, root):
    from driver_runs import run_with_hashes
    from megatron_sdp4bit.training.arguments import parse_args

    def go(name, extra, iters):
        args = parse_args(COMMON + extra + ["--train-iters", str(iters),
                                            "--run-dir", os.path.join(root, name)])
        return run_with_hashes(args)

    ckpt = os.path.join(root, "ckpt")
    return {
        "exact": go("exact", [], STEPS),
        "sdp": go("sdp", SDP, STEPS),
        "first_half": go("first_half", SDP + ["--save", ckpt], STEPS // 2),
        "second_half": go("second_half", SDP + ["--load", ckpt], STEPS),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return driver_world(tmp_path_factory, "driver", _driver_world, 4, timeout_s=900, start="spawn")


def test_loss_decreases_with_and_without_sdp4bit(runs):
    root, _ = runs
    for name in ("exact", "sdp"):
        losses = train_log(root, name)
        assert losses[STEPS] < 0.9 * losses[1], f"{name}: {losses[1]:.3f} -> {losses[STEPS]:.3f}"
    exact, sdp = train_log(root, "exact")[STEPS], train_log(root, "sdp")[STEPS]
    assert abs(sdp - exact) < 0.05 * exact


def test_ranks_agree(runs):
    _, results = runs
    for name in ("exact", "sdp", "second_half"):
        assert len({r[name]["weights_sha256"] for r in results}) == 1, name
        assert len({r[name]["final_train_loss"] for r in results}) == 1, name


def test_metrics_file_has_every_field(runs):
    root, _ = runs
    records = read_metrics(os.path.join(root, "sdp", "metrics.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == STEPS
    for field in TRAIN_FIELDS:
        assert field in train[-1], field
    assert 0.2 < train[-1]["wire_ratio"] < 0.3  # ~4 bits instead of 16/32
    assert train[-1]["weight_quant_rel_error"] > 0
    last = train[-1]  # the 4-bit groups' shape: a crest factor lies in [1, sqrt(128)]
    assert 1 <= last["grad_crest_median"] <= last["grad_crest_p99"] <= last["grad_crest_max"] <= 128 ** 0.5
    assert 0 <= last["grad_crest_share_above_8"] <= 1
    assert 0 < last["grad_4bit_error_tlq"] < 1 and 0 < last["grad_4bit_error_tlq_hs"] < 1
    assert [r for r in records if r["kind"] == "valid"]
    assert os.path.isfile(os.path.join(root, "sdp", "loss.png"))
    exact = read_metrics(os.path.join(root, "exact", "metrics.jsonl"))
    assert exact[0]["wire_ratio"] == 1.0
    assert exact[0]["grad_crest_p99"] is None  # no gradient quantized: nothing sampled
    # no overlap flag: megatron waits on no handle of the layer's, so nothing was timed
    assert last["wait_reduce_scatter_s"] is None and last["wait_all_gather_s"] is None


def test_resume_continues_the_same_curve_bit_for_bit(runs):
    root, results = runs
    straight = train_log(root, "sdp")
    resumed = {**train_log(root, "first_half"), **train_log(root, "second_half")}
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[i] for i in range(1, STEPS + 1)] == [straight[i] for i in range(1, STEPS + 1)]
    assert results[0]["second_half"]["weights_sha256"] == results[0]["sdp"]["weights_sha256"]
    latest = open(os.path.join(root, "ckpt", "latest_checkpointed_iteration.txt")).read().strip()
    assert latest == str(STEPS // 2)
