"""Ordinary flags that used to lose work (issue 18), through the command line, one process.

Each case runs ``python -m megatron_sdp4bit.pretrain`` as a user would, on the
embedded corpus (a temporary cache), and checks what the user sees: the exit
code, the summary and the checkpoints left behind.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_sdp4bit.training.checkpoint import LATEST
from megatron_sdp4bit.training.metrics import read_metrics

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "1", "--log-interval", "1",
        "--no-progress-bar"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _cli(tmp_path, cache, *argv):
    env = dict(os.environ, PYTHONWARNINGS="ignore", SDP4BIT_CACHE=cache, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, *argv,
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)


def test_eval_iters_0_trains_and_saves_without_evaluating(tmp_path, cache):
    """Before: ``RuntimeError: stack expects a non-empty TensorList`` at the first
    evaluation, exit 1, and the final checkpoint never written."""
    done = _cli(tmp_path, cache, "--eval-iters", "0", "--eval-interval", "2", "--train-iters", "3",
                "--default-corpus-mb", "1", "--split", "90,10,0", "--save", str(tmp_path / "ckpt"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ckpt" / LATEST).read_text().strip() == "3"
    assert "final valid loss    not evaluated (--eval-iters 0)" in done.stdout
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["iteration"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert not [r for r in records if r["kind"] == "valid"]


def test_a_small_corpus_with_the_default_split_trains_and_evaluates(tmp_path, cache):
    """Before: refused because the test split (weight 1 of 1000) got no document of the
    1 MB corpus (49 documents), though the driver never reads the test split."""
    done = _cli(tmp_path, cache, "--default-corpus-mb", "1", "--train-iters", "2", "--eval-interval", "2",
                "--eval-iters", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    (valid,) = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "valid"]
    assert valid["iteration"] == 2 and valid["loss"] > 0
