"""SIGTERM (a scheduler's preemption) with --exit-signal-handler: save, then stop (issue 18 item 6).

Before, SIGTERM ended the job with nothing saved since the last interval. Now the
signal only sets a flag; after every iteration the ranks agree whether any has
it, save and stop, with exit code 143 (128 + SIGTERM).

- In one forked world of 2 gloo ranks: the signal reaches rank 1 alone after
  iteration 3 (every rank stops there, saved); it reaches rank 0 after 2 and
  rank 1 after 4 (every rank stops after 2: the first one counts); the resumed
  run continues the uninterrupted run's losses bit for bit.
- Under torchrun, 2 ranks: SIGTERM to the whole job (torchrun and its workers, as
  a scheduler sends it) while it trains; the job ends with the checkpoint of the
  iteration it stopped at, one line from rank 0, and ``--load`` resumes from it.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from driver_runs import TINY_GPT, driver_world, train_log
from megatron_sdp4bit.training.checkpoint import LATEST, check_files, read_manifest
from megatron_sdp4bit.training.metrics import read_metrics
from megatron_sdp4bit.training.signals import StoppedBySignal

TINY = TINY_GPT + ["--lr-decay-iters", "1000", "--bf16",
                   "--sdp4bit", "--sdp4bit-ranks-per-node", "1"]
HANDLER = ["--exit-signal-handler"]


def _signal_at(when: dict):
    """An on_step callback: SIGTERM to this very process after the given iteration
    (``{rank: iteration}``)."""
    import torch

    def send(run):
        if when.get(torch.distributed.get_rank()) == run.iteration:
            os.kill(os.getpid(), signal.SIGTERM)

    return send


def _world(rank, world_size, root):
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.run import TrainingRun
    from megatron_sdp4bit.training.setup import set_up

    def go(name, flags, when=None):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            run = TrainingRun(set_up(parse_args(TINY + ["--run-dir", os.path.join(root, name)] + flags)),
                              on_step=_signal_at(when or {}))
            try:
                run.train()
                stopped = None
            except StoppedBySignal as exc:
                stopped = (str(exc), exc.exit_code)
        return {"stdout": text.getvalue(), "stopped": stopped, "iteration": run.iteration}

    at = lambda name: os.path.join(root, name)  # noqa: E731
    return {
        "straight": go("straight", ["--train-iters", "5"]),
        "one_rank": go("one_rank", HANDLER + ["--train-iters", "5", "--save", at("ck")], {1: 3}),
        "resumed": go("resumed", ["--train-iters", "5", "--load", at("ck")]),
        "different_steps": go("different_steps", HANDLER + ["--train-iters", "5", "--save", at("ck2")],
                              {0: 2, 1: 4}),
        "no_save": go("no_save", HANDLER + ["--train-iters", "5"], {0: 1}),
        "at_the_end": go("at_the_end", HANDLER + ["--train-iters", "2", "--save", at("ck3")], {1: 2}),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return driver_world(tmp_path_factory, "signals", _world, 2, timeout_s=600)


def test_a_signal_on_one_rank_saves_and_stops_every_rank_at_the_same_step(world):
    root, results = world
    ck = os.path.join(root, "ck")
    for result in results:
        assert result["one_rank"]["iteration"] == 3
        assert result["one_rank"]["stopped"] == (
            f"SIGTERM received: stopped after iteration 3, its checkpoint is saved in {ck}; resume with "
            f"--load {ck}", 143)
    assert open(os.path.join(ck, LATEST)).read().strip() == "3"
    assert check_files(os.path.join(ck, "iter_0000003"), read_manifest(os.path.join(ck, "iter_0000003"))) == []


def test_the_resumed_run_continues_the_uninterrupted_curve(world):
    root, results = world
    straight, stopped, resumed = (train_log(root, n) for n in ("straight", "one_rank", "resumed"))
    assert sorted(stopped) == [1, 2, 3] and sorted(resumed) == [4, 5]
    assert {**stopped, **resumed} == straight
    assert f"resumed from {os.path.join(root, 'ck')} at iteration 3" in results[0]["resumed"]["stdout"]


def test_the_first_rank_to_get_the_signal_decides_the_step(world):
    root, results = world
    for result in results:
        assert result["different_steps"]["iteration"] == 2
    assert open(os.path.join(root, "ck2", LATEST)).read().strip() == "2"


def test_without_save_the_run_says_nothing_was_saved(world):
    _, results = world
    for result in results:
        assert result["no_save"]["stopped"] == (
            "SIGTERM received: stopped after iteration 1, nothing saved (no --save)", 143)


def _wait_for_iteration(metrics: str, iteration: int, job, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job.poll() is None:
        if os.path.isfile(metrics) and any(r["kind"] == "train" and r["iteration"] >= iteration
                                           for r in read_metrics(metrics)):
            return
        time.sleep(0.2)
    raise AssertionError(f"the job did not reach iteration {iteration} in {timeout_s} s")


def test_sigterm_to_a_torchrun_job_saves_and_the_job_resumes_from_it(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", SDP4BIT_CACHE=str(tmp_path / "cache"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--monitor-interval", "0.1", "-m", "megatron_sdp4bit.pretrain", *TINY]
    ck, metrics = tmp_path / "ck", tmp_path / "run" / "metrics.jsonl"
    job = subprocess.Popen(torchrun + HANDLER + ["--train-iters", "1000", "--save", str(ck),
                                                 "--save-interval", "500", "--run-dir", str(tmp_path / "run")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
                           start_new_session=True)  # its own process group, as a scheduler's job
    try:
        _wait_for_iteration(str(metrics), 3, job, timeout_s=600)
        os.killpg(job.pid, signal.SIGTERM)
        signalled = time.monotonic()
        out, err = job.communicate(timeout=120)
        seconds_to_exit = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    # torchrun gives its workers 30 s before SIGKILL (as schedulers do): well within
    print(f"the job ended {seconds_to_exit:.1f} s after SIGTERM")
    assert seconds_to_exit < 20, seconds_to_exit
    saved = int((ck / LATEST).read_text())
    logged = [r["iteration"] for r in read_metrics(str(metrics)) if r["kind"] == "train"]
    assert saved >= 3 and logged[-1] == saved, (saved, logged, err[-2000:])
    ours = [line for line in err.splitlines() if line.startswith("sdp4bit-pretrain:")]
    assert ours == [f"sdp4bit-pretrain: stopped: SIGTERM received: stopped after iteration {saved}, its "
                    f"checkpoint is saved in {ck}; resume with --load {ck}"], err[-3000:]
    resumed = subprocess.run(torchrun + ["--train-iters", str(saved + 1), "--load", str(ck),
                                         "--run-dir", str(tmp_path / "resumed")],
                             capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ck} at iteration {saved}" in resumed.stdout


def test_a_signal_after_the_last_iteration_lets_the_run_complete(world):
    """The final checkpoint is written with the handler still in place: exit 0, done."""
    root, results = world
    for result in results:
        assert result["at_the_end"]["stopped"] is None and result["at_the_end"]["iteration"] == 2
    assert open(os.path.join(root, "ck3", LATEST)).read().strip() == "2"
