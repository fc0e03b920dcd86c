"""Where a run's metrics go (``--run-dir``, ``--tensorboard-dir``), as a new user gets
them wrong (issue 28, round two): a folder that cannot be written is one line before
training, a ``--tensorboard-dir`` nothing would write to is refused, and a disk that
fills up under the metrics stops the metrics, not the run (before: a traceback of
the logging rank, which took the job and every step since the last checkpoint)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_sdp4bit.training import metrics
from megatron_sdp4bit.training.checkpoint import latest_iteration
from megatron_sdp4bit.training.metrics import MetricsLogger, check_run_folders

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--default-corpus-mb", "1", "--eval-iters", "0", "--no-progress-bar"]


def _cli(*argv, cwd):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, *argv],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


class _Writer:
    """A stand-in for tensorboard's SummaryWriter (tensorboard need not be installed)."""

    def __init__(self, folder):
        os.makedirs(folder, exist_ok=True)


def test_folders_that_cannot_be_written_are_named_with_their_flag(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for run_dir in (blocker, blocker / "runs" / "1"):
        with pytest.raises(ValueError) as refused:
            check_run_folders(str(run_dir), None)
        assert str(refused.value) == (f"--run-dir {run_dir} cannot be written ({blocker} is a file): the run's "
                                      "metrics go there; pass a --run-dir you can write")
    monkeypatch.setattr(metrics, "summary_writer_class", lambda: None)
    check_run_folders(str(tmp_path / "run"), None)  # no tensorboard, none asked for: fine
    with pytest.raises(ValueError, match=r"^--tensorboard-dir tb: tensorboard is not installed, so no events "
                       r"would be written there; install it \(pip install tensorboard\), or drop --tensorboard-dir"):
        check_run_folders(str(tmp_path / "run"), "tb")
    monkeypatch.setattr(metrics, "summary_writer_class", lambda: _Writer)
    with pytest.raises(ValueError, match=r"^--tensorboard-dir .*a_file/tb cannot be written \(.*a_file is a file\)"):
        check_run_folders(str(tmp_path / "run"), str(blocker / "tb"))
    check_run_folders(str(tmp_path / "run"), str(tmp_path / "tb"))


def test_a_run_dir_that_is_a_file_stops_the_driver_before_training_in_one_line(tmp_path):
    """Before: ``FileExistsError`` with its traceback, after the whole set-up."""
    (tmp_path / "a_file").write_text("x")
    done = _cli("--train-iters", "2", "--run-dir", "a_file", cwd=str(tmp_path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "sdp4bit-pretrain: error: --run-dir a_file cannot be written (" + str(tmp_path / "a_file")
        + " is a file): the run's metrics go there; pass a --run-dir you can write")
    assert "Traceback" not in done.stderr and "iter " not in done.stdout


def test_a_full_disk_under_the_metrics_is_said_once_and_training_goes_on(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), enabled=True, total_iters=3, progress_bar=False)
    logger._file.close()
    logger._file = open("/dev/full", "w")  # every write reaches the disk full (ENOSPC)
    for iteration in (1, 2):
        logger.log("valid", {"iteration": iteration, "loss": 1.0})
    logger.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: iteration 1: writing the metrics in {tmp_path} failed (No space left on device); "
                   "training goes on, its log lines below are the only record"]


def test_a_run_whose_metrics_cannot_be_written_still_trains_and_saves(tmp_path):
    """End to end: ``metrics.jsonl`` on a full disk (a link to /dev/full). Before: the
    first log line raised ``OSError: [Errno 28]`` on the logging rank, exit 1, and the
    run's checkpoint was never written."""
    (tmp_path / "run").mkdir()
    os.symlink("/dev/full", tmp_path / "run" / "metrics.jsonl")
    done = _cli("--train-iters", "2", "--log-interval", "1", "--run-dir", "run", "--save", "ck",
                cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert latest_iteration(str(tmp_path / "ck")) == 2
    assert "iter      2/2 | loss" in done.stdout
    assert [line for line in done.stderr.splitlines() if "metrics" in line] == [
        "warning: iteration 1: writing the metrics in run failed (No space left on device); training goes on, "
        "its log lines below are the only record"]


def _records(path):
    return [(r["kind"], r["iteration"]) for r in metrics.read_metrics(str(path))]


def test_records_past_the_start_are_moved_aside_not_mixed_with_this_runs(tmp_path, capsys):
    """Issue 28, round two: a run started again in the same --run-dir appended to the
    earlier run's metrics.jsonl (iterations 1, 2, 3, 1, 2, ...), and loss.png drew both
    as one curve; a resume after a crash logged the steps after its checkpoint twice."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"kind": "train", "iteration": {i}, "loss": {9 - i}}}\n' for i in (1, 2, 3))
                    + '{"kind": "valid", "iteration": 2, "loss": 7}\n{"kind": "train", "iter')  # cut by a crash
    logger = MetricsLogger(str(tmp_path), enabled=True, total_iters=4, progress_bar=False, start_iteration=2)
    logger.log("valid", {"iteration": 3, "loss": 5.5})
    logger.close()
    assert _records(path) == [("train", 1), ("train", 2), ("valid", 2), ("valid", 3)]
    (aside,) = tmp_path.glob("metrics.replaced-*.jsonl")
    assert aside.read_text() == '{"kind": "train", "iteration": 3, "loss": 6}\n{"kind": "train", "iter'
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{path} held records past iteration 2, where this run resumes (steps trained after its checkpoint, or "
        f"another run's): they are moved to {aside}")
    MetricsLogger(str(tmp_path), enabled=True, total_iters=4, progress_bar=False).close()  # from scratch
    assert _records(path) == [] and "held an earlier run's records, and this run starts from scratch" in \
        capsys.readouterr().out
    assert MetricsLogger(str(tmp_path / "new"), enabled=True, total_iters=4, progress_bar=False).path  # no file yet
    assert capsys.readouterr().out == ""
