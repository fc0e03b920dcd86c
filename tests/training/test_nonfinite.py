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

from driver_runs import driver_world
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


def _poison_gradients_at(rank: int, iterations: set):
    """A ``prepare(parts)`` that puts a NaN into this rank's gradient buffer before the
    gradient sync of the given iterations (counted from 1), through megatron's
    ``finalize_model_grads_func`` callback."""
    def prepare(parts):
        ddp = parts.ddp
        finalize = ddp.config.finalize_model_grads_func
        calls = [0]

        def finalize_with_nan(*args, **kwargs):
            calls[0] += 1
            if rank == POISONED_RANK and calls[0] in iterations:
                ddp.buffers[0].grad_data[POISONED_ELEMENT] = float("nan")
            return finalize(*args, **kwargs)

        ddp.config.finalize_model_grads_func = finalize_with_nan

    return prepare


def _infinite_loss_at(rank: int, iterations: set):
    """A forward step whose loss is +Inf on this rank at the given iterations (one
    micro-batch per step) while its gradients stay finite: the loss is shifted by a
    constant, whose gradient is 0, as for a token whose probability underflowed to 0."""
    from megatron_sdp4bit.training.step import forward_step

    calls = [0]

    def forward_step_with_inf(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        calls[0] += 1
        if rank != POISONED_RANK or calls[0] not in iterations:
            return output, loss_func
        return output, lambda output_tensor: loss_func(output_tensor + float("inf"))

    return forward_step_with_inf


def _nonfinite_world(rank, world_size, root):
    from driver_runs import run_with_hashes
    from megatron_sdp4bit.pretrain import NonFiniteTraining
    from megatron_sdp4bit.training.arguments import parse_args

    recovered = run_with_hashes(parse_args(COMMON + [
        "--train-iters", "8", "--log-interval", "4", "--run-dir", os.path.join(root, "recovered")]),
        prepare=_poison_gradients_at(rank, {3, 4}))

    infinite_loss = run_with_hashes(parse_args(COMMON + [
        "--train-iters", "3", "--log-interval", "3", "--run-dir", os.path.join(root, "inf-loss")]),
        forward_step=_infinite_loss_at(rank, {2}))

    ckpt = os.path.join(root, "ckpt")
    try:
        run_with_hashes(parse_args(COMMON + [
            "--train-iters", "10", "--log-interval", "5", "--max-consecutive-skipped-iters", "3",
            "--save", ckpt, "--save-interval", "2", "--run-dir", os.path.join(root, "diverged")]),
            prepare=_poison_gradients_at(rank, set(range(3, 100))))  # iterations 3.. poisoned
        stopped = None
    except NonFiniteTraining as exc:
        stopped = str(exc)
    return {"recovered": recovered, "infinite_loss": infinite_loss, "stopped": stopped}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return driver_world(tmp_path_factory, "nonfinite", _nonfinite_world, 4, timeout_s=900, start="spawn")


def _train_records(root, name):
    return [r for r in read_metrics(os.path.join(root, name, "metrics.jsonl")) if r["kind"] == "train"]


def test_a_nan_on_one_rank_skips_the_step_on_every_rank_and_training_goes_on(runs):
    root, results = runs
    records = _train_records(root, "recovered")
    assert [r["skipped"] for r in records] == [2, 0]  # iterations 3 and 4, counted in their window
    assert all(math.isfinite(r["loss"]) for r in records)
    assert len({r["recovered"]["weights_sha256"] for r in results}) == 1
    assert math.isfinite(results[0]["recovered"]["final_train_loss"])


def test_quantization_errors_of_a_skipped_sample_are_not_reported(runs):
    root, _ = runs
    first, second = _train_records(root, "recovered")
    # iteration 4, the first window's sampled step, was skipped: nothing measured, and
    # neither 0 nor an earlier figure stands in for it
    assert first["weight_quant_rel_error"] is None and first["grad_quant_rel_error"] is None
    assert second["weight_quant_rel_error"] > 0 and second["grad_quant_rel_error"] > 0


def test_an_infinite_loss_with_finite_gradients_on_one_rank_is_skipped_on_every_rank(runs):
    root, results = runs
    (record,) = _train_records(root, "inf-loss")
    assert record["skipped"] == 1 and math.isfinite(record["loss"])  # as Megatron-LM: not averaged in
    assert len({r["infinite_loss"]["weights_sha256"] for r in results}) == 1
    assert len({r["infinite_loss"]["weights_sha256_per_step"][1] for r in results}) == 1
    for result in results:  # step 2 skipped: the weights after it are those after step 1
        per_step = result["infinite_loss"]["weights_sha256_per_step"]
        assert per_step[1] == per_step[0] != per_step[2]


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


def test_lr_1e6_stops_with_exit_3_naming_the_iteration_and_keeps_the_good_checkpoint(tmp_path):
    """The issue's run: NaN from the second step on. fp32 without the distributed
    optimizer, the one megatron optimizer with no Inf/NaN check of its own."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONWARNINGS="ignore", SDP4BIT_CACHE=str(tmp_path / "cache"))
    env.pop("RANK", None)
    result = subprocess.run(
        [sys.executable, "-m", "megatron_sdp4bit.pretrain", "--num-layers", "1", "--hidden-size", "32",
         "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
         "--train-iters", "20", "--lr", "1e6", "--default-corpus-mb", "1", "--split", "90,10,0",
         "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "1", "--no-progress-bar",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 3, result.stderr[-3000:]
    (stopped,) = [line for line in result.stderr.splitlines() if line.startswith("sdp4bit-pretrain:")]
    assert stopped.startswith("sdp4bit-pretrain: stopped: iteration 4: the loss or the gradients were "
                              "not finite (Inf/NaN) for 3 consecutive iterations (2-4)"), stopped
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["skipped"] for r in records] == [0, 1, 1, 1]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (tmp_path / "ckpt" / "iter_0000002").exists()


@pytest.mark.parametrize("error, code", [("nonfinite", 3), ("replicas", 4), ("checkpoint", 2)])
def test_main_maps_each_stop_to_its_exit_code_with_one_line(monkeypatch, capsys, error, code):
    """What the driver's process returns (a launcher sees it as the rank's exit code)."""
    import torch

    import megatron_sdp4bit.pretrain as driver
    from megatron_sdp4bit.megatron.consistency import ReplicaMismatch
    from megatron_sdp4bit.training.checkpoint import CheckpointError
    from harness import free_port

    raised = {"nonfinite": driver.NonFiniteTraining("iteration 7: ..."),
              "replicas": ReplicaMismatch("bucket 0: ranks [0] vs ranks [1]"),
              "checkpoint": CheckpointError("iter_0000010/rank_00001.pt: size 3, expected 9")}[error]

    def failing_run(args, **kwargs):  # as the real run: the process group exists when it fails
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                             rank=0, world_size=1)
        raise raised

    monkeypatch.setattr(driver, "run", failing_run)
    assert driver.main(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                        "--seq-length", "16", "--train-iters", "2", "--micro-batch-size", "1"]) == code
    assert not torch.distributed.is_initialized()  # shut down on the way out
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sdp4bit-pretrain:")]
    assert len(ours) == 1 and str(raised) in ours[0], ours
