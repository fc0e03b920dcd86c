"""Two jobs saving into one --save folder: the second is refused, naming the first.

Job A trains (one process) with ``--save ck``; job B, started while A runs with
the same ``--save``, stops before anything is built, in one line naming A's pid.
A is then killed (SIGKILL, as a crashed job ends): its lock goes with it, and a
third job saves into ``ck`` as usual.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from megatron_sdp4bit.training.checkpoint import LATEST
from megatron_sdp4bit.training.metrics import read_metrics

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "1", "--log-interval", "1",
        "--eval-interval", "100000", "--eval-iters", "1", "--default-corpus-mb", "1",
        "--split", "90,10,0", "--no-progress-bar"]


def _command(tmp_path, name, *argv):
    return [sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, *argv, "--run-dir", str(tmp_path / name)]


def test_a_second_job_on_one_save_folder_is_refused_and_a_killed_job_leaves_no_lock(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", SDP4BIT_CACHE=str(tmp_path / "cache"))
    env.pop("RANK", None)
    ck = tmp_path / "ck"
    first = subprocess.Popen(_command(tmp_path, "a", "--train-iters", "100000", "--save", str(ck),
                                      "--save-interval", "100000"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path, env=env)
    try:
        metrics, deadline = tmp_path / "a" / "metrics.jsonl", time.monotonic() + 600
        while not (metrics.is_file() and read_metrics(str(metrics))):
            assert first.poll() is None and time.monotonic() < deadline, "job A did not start training"
            time.sleep(0.2)
        second = subprocess.run(_command(tmp_path, "b", "--train-iters", "2", "--save", str(ck)),
                                capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert second.returncode == 2
    ours = [line for line in second.stderr.splitlines() if line.startswith("sdp4bit-pretrain:")]
    assert len(ours) == 1 and ours[0].startswith(
        f"sdp4bit-pretrain: error: --save {ck} is being written by another job (pid {first.pid} on "
        f"{socket.gethostname()}, since "), second.stderr[-3000:]
    assert ours[0].endswith("two jobs saving into one folder replace each other's checkpoints; wait for it "
                            "to end, or choose another --save")
    assert "iter " not in second.stdout
    third = subprocess.run(_command(tmp_path, "c", "--train-iters", "1", "--save", str(ck), "--load", str(ck)),
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert (ck / LATEST).read_text().strip() == "1"
