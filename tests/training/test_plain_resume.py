"""Runs without the distributed optimizer resume (issue 28 item 1).

A run with no SDP4Bit flag and no ``--use-distributed-optimizer`` (the driver's
default, as Megatron-LM's) uses megatron's plain optimizers (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params`` with ``--bf16``). Such runs saved, but every
resume died after set-up with ``AttributeError: 'FP32Optimizer' object has no
attribute 'data_parallel_group'``: the layer's load hook asked every optimizer for
its data-parallel group, which only the distributed one has.

Forked worlds of 1 and 2 gloo ranks, fp32 and bf16: 2 steps saved, resumed to 4,
and a straight 4-step run; the resume must equal the straight run bit for bit (the
weights after every step, the losses).
"""
from __future__ import annotations

import os

import pytest

from driver_runs import TINY_GPT, captured_run, driver_world, train_log
from megatron_sdp4bit.megatron.consistency import weights_sha256

TINY = TINY_GPT + ["--lr-decay-iters", "4"]
PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}


def _plain_world(rank, world_size, root):
    def go(name, flags):
        hashes = []
        result = captured_run(TINY + ["--run-dir", os.path.join(root, name)] + flags,
                              on_step=lambda run: hashes.append(weights_sha256(run.ddp)))
        return dict(result, hashes=hashes)

    out = {}
    for precision, flags in PRECISIONS.items():
        ck = os.path.join(root, f"ck_{precision}")
        out[f"first_{precision}"] = go(f"first_{precision}", flags + ["--train-iters", "2", "--save", ck])
        out[f"resumed_{precision}"] = go(f"resumed_{precision}", flags + ["--train-iters", "4", "--load", ck])
        out[f"straight_{precision}"] = go(f"straight_{precision}", flags + ["--train-iters", "4"])
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def plain_world(request, tmp_path_factory):
    return driver_world(tmp_path_factory, f"plain{request.param}", _plain_world, request.param, timeout_s=600)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_a_plain_run_resumes_bit_for_bit(plain_world, precision):
    """Before: AttributeError: 'FP32Optimizer' (bf16: 'Float16OptimizerWithFloat16Params')
    object has no attribute 'data_parallel_group', on every rank."""
    root, results = plain_world
    for result in results:
        resumed, straight = result[f"resumed_{precision}"], result[f"straight_{precision}"]
        assert resumed["error"] is None, resumed["error"]
        assert resumed["hashes"] == straight["hashes"][2:]
    ck = os.path.join(root, f"ck_{precision}")
    assert f"resumed from {ck} at iteration 2" in results[0][f"resumed_{precision}"]["stdout"]
    resumed = train_log(root, f"resumed_{precision}")
    assert sorted(resumed) == [3, 4]
    assert resumed == {i: train_log(root, f"straight_{precision}")[i] for i in (3, 4)}
