"""Runs without the distributed optimizer resume (issue 28 item 1).

A run with no SDP4Bit flag and no ``--use-distributed-optimizer`` (the driver's
default, as Megatron-LM's) uses megatron's plain optimizers (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params`` with ``--bf16``). Such runs saved, but every
resume died after set-up with ``AttributeError: 'FP32Optimizer' object has no
attribute 'data_parallel_group'``: the layer's load hook asked every optimizer for
its data-parallel group, which only the distributed one has.

Such a checkpoint resumed with ``--sdp4bit`` (which implies the distributed
optimizer) was refused with ``dtypes [], this run has [['float32', 'float32']]``.
Now all of its state is carried over into the distributed optimizer's shards
(``training/checkpoint/convert.py``); the other way, a distributed optimizer's
checkpoint resumed without it, is refused in one line that names the flag.

Forked worlds of 1 and 2 gloo ranks, fp32 and bf16: 2 steps saved, resumed to 4,
and a straight 4-step run; the resume must equal the straight run bit for bit (the
weights after every step, the losses). The same checkpoint resumed with
``--use-distributed-optimizer`` trains on as the plain resume does (the first
step's loss equal, the next within 1e-6: the optimizer state came over whole), and
with ``--sdp4bit``.
"""
from __future__ import annotations

import os

import pytest

from driver_runs import TINY_GPT, captured_run, driver_world, train_log
from megatron_sdp4bit.training.checkpoint import MANIFEST
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
        out[f"distributed_{precision}"] = go(f"distributed_{precision}", flags + [
            "--train-iters", "4", "--load", ck, "--use-distributed-optimizer"])
        out[f"sdp4bit_{precision}"] = go(f"sdp4bit_{precision}", flags + [
            "--train-iters", "4", "--load", ck, "--sdp4bit", "--sdp4bit-ranks-per-node", "1"])
    out.update(_refusals(root, go))
    return out


def _refusals(root, go) -> dict:
    """A distributed optimizer's checkpoint resumed without it; a plain one of fp32
    params with --bf16; a plain one saved before its params' names were recorded."""
    import json
    import shutil

    import torch

    if torch.distributed.get_rank() == 0:
        shutil.copytree(os.path.join(root, "ck_fp32"), os.path.join(root, "ck_old"))
        path = os.path.join(root, "ck_old", "iter_0000002", MANIFEST)
        manifest = json.load(open(path))
        del manifest["layout"]["optimizer"], manifest["layout"]["params_dtype"]
        json.dump(manifest, open(path, "w"))
    torch.distributed.barrier()
    ck_fp32, ck_distributed = os.path.join(root, "ck_fp32"), os.path.join(root, "ck_distributed")
    return {
        "saved_distributed": go("saved_distributed", ["--train-iters", "2", "--save", ck_distributed,
                                                      "--use-distributed-optimizer"]),
        "distributed_to_plain": go("distributed_to_plain", ["--train-iters", "4", "--load", ck_distributed]),
        "fp32_to_bf16": go("fp32_to_bf16", ["--train-iters", "4", "--load", ck_fp32, "--bf16", "--sdp4bit"]),
        "old_plain": go("old_plain", ["--train-iters", "4", "--load", os.path.join(root, "ck_old"), "--sdp4bit"]),
    }


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


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_a_plain_checkpoint_resumes_with_the_distributed_optimizer(plain_world, precision):
    """Before: refused, '... was saved with parameter/gradient dtypes [], this run has
    [['float32', 'float32']] (--bf16 and the distributed optimizer must be as when it
    was saved)'. The distributed optimizer with the exact collectives continues as the
    plain one does; SDP4Bit resumes from the same weights."""
    root, results = plain_world
    ck = os.path.join(root, f"ck_{precision}")
    plain = train_log(root, f"resumed_{precision}")
    for name in (f"distributed_{precision}", f"sdp4bit_{precision}"):
        for result in results:
            assert result[name]["error"] is None, result[name]["error"]
        stdout = results[0][name]["stdout"]
        assert (f"{ck}/iter_0000002 was saved with megatron's plain optimizer, this run has the distributed one: "
                "every param's fp32 main weights, Adam moments and step are carried over into this run's "
                "shards") in stdout
        assert f"resumed from {ck} at iteration 2" in stdout
        assert sorted(train_log(root, name)) == [3, 4] and train_log(root, name)[3] == plain[3]
    assert train_log(root, f"distributed_{precision}")[4] == pytest.approx(plain[4], rel=1e-6, abs=0)


def test_other_optimizers_and_precisions_are_refused_in_one_line(plain_world):
    root, results = plain_world
    lines = {
        "distributed_to_plain": (
            f"checkpoint {os.path.join(root, 'ck_distributed', 'iter_0000002')} was saved with the distributed "
            "optimizer, this run has megatron's plain one (no --use-distributed-optimizer, no --sdp4bit flag): "
            "resume with --use-distributed-optimizer (every --sdp4bit flag implies it; --sdp4bit-preset baseline "
            "keeps the layer with the exact collectives)"),
        "fp32_to_bf16": (f"checkpoint {os.path.join(root, 'ck_fp32', 'iter_0000002')} was saved with float32 "
                         "parameters, this run has bfloat16: resume without --bf16"),
        "old_plain": (
            f"checkpoint {os.path.join(root, 'ck_old', 'iter_0000002')} was saved with megatron's plain optimizer "
            "by an older version, which did not record which parameter its state belongs to, so this run's "
            "distributed optimizer (--use-distributed-optimizer, implied by every --sdp4bit flag) cannot take "
            "it: resume it without --use-distributed-optimizer and --sdp4bit flags (its next checkpoint records "
            "it)"),
    }
    for result in results:
        for case, line in lines.items():
            assert result[case]["error"] == line
            assert "resumed" not in result[case]["stdout"]
