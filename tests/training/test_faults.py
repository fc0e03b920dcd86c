"""A rank killed mid-step: the job ends quickly, and --load resumes the same curve.

Three torchrun jobs of 4 CPU ranks (2 emulated nodes x 2), one after another:
an uninterrupted run; the same run with rank 2 killed (SIGKILL) in the forward
pass of iteration 5, after the checkpoint of iteration 4; and a rerun of the
second with --load, which must continue from iteration 4 and log the losses of
the uninterrupted run, bit for bit.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from driver_runs import train_log

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, KILLED_AT, SAVE_EVERY = 8, 5, 2
FLAGS = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(STEPS), "--lr", "3e-3", "--lr-warmup-iters", "1", "--bf16",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    "--default-corpus-mb", "1", "--split", "90,10,0", "--no-progress-bar",
    "--sdp4bit", "--sdp4bit-ranks-per-node", "2", "--save-interval", str(SAVE_EVERY),
]


def _torchrun(script_args, env, timeout=600):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", "--monitor-interval", "0.1", *script_args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    env = {**os.environ, "SDP4BIT_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)),
                                          os.environ.get("PYTHONPATH", "")])}
    from megatron_sdp4bit.data import prepare_default_corpus

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP4BIT_CACHE", env["SDP4BIT_CACHE"])
        prepare_default_corpus(max_mb=1)
    driver = ["-m", "megatron_sdp4bit.pretrain"]
    straight = _torchrun(driver + FLAGS + ["--save", str(root / "straight_ckpt"),
                                           "--run-dir", str(root / "straight")], env)
    stamp = root / "killed_at"
    killed = _torchrun([os.path.join(HERE, "fault_entry.py"), "2", str(KILLED_AT), str(stamp)]
                       + FLAGS + ["--save", str(root / "ckpt"), "--run-dir", str(root / "killed")], env)
    ended = time.time()
    latest_after_kill = (root / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    resumed = _torchrun(driver + FLAGS + ["--save", str(root / "ckpt"), "--load", str(root / "ckpt"),
                                          "--run-dir", str(root / "resumed")], env)
    return root, straight, killed, ended - float(stamp.read_text()), latest_after_kill, resumed


def test_a_killed_rank_ends_the_job_quickly_with_an_error(jobs):
    root, straight, killed, seconds_to_exit, latest, _ = jobs
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert killed.returncode != 0
    print(f"job ended {seconds_to_exit:.2f} s after the kill")
    assert seconds_to_exit < 15, seconds_to_exit  # a hang would last the 10-minute PG timeout
    assert "Signals.SIGKILL" in killed.stderr or "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert latest == str(KILLED_AT - 1)


def test_load_resumes_from_the_last_checkpoint_on_the_same_curve(jobs):
    root, _, _, _, _, resumed = jobs
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {root / 'ckpt'} at iteration {KILLED_AT - 1}" in resumed.stdout
    straight, again = train_log(root, "straight"), train_log(root, "resumed")
    assert sorted(again) == list(range(KILLED_AT, STEPS + 1))
    assert [again[i] for i in sorted(again)] == [straight[i] for i in sorted(again)]
