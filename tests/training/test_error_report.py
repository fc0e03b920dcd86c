"""An error after start-up under torchrun: one line, from rank 0, and in torchrun's own report
(issue 18 item 7).

Before, every rank printed it (``error (rank 0): ...``, ``error (rank 1): ...``) and
torchrun's traceback and failure report followed, its "Root Cause" saying only
"To enable traceback see ...". Now an error every rank meets alike (a refused
--load, missing data files, a save that failed, a stop) is printed once by rank 0,
and every rank gives torchrun the same line for its report.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--train-iters", "2", "--micro-batch-size", "1",
        "--default-corpus-mb", "1", "--split", "90,10,0", "--no-progress-bar"]


def _torchrun(tmp_path, *argv):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", SDP4BIT_CACHE=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.1", "-m", "megatron_sdp4bit.pretrain", *TINY, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


@pytest.mark.parametrize("case", ["load", "data"])
def test_an_error_every_rank_meets_is_one_line_and_the_root_cause_of_torchruns_report(tmp_path, case):
    argv, expected = {
        "load": (["--load", str(tmp_path / "typo")],
                 f"sdp4bit-pretrain: error: --load {tmp_path / 'typo'} does not exist: pass the folder --save "
                 "wrote, or drop --load to start from scratch"),
        "data": (["--data-path", str(tmp_path / "missing"), "--tokenizer-type", "GPT2BPETokenizer"],
                 f"sdp4bit-pretrain: error: missing indexed dataset file(s): {tmp_path / 'missing'}.bin, "
                 f"{tmp_path / 'missing'}.idx (--data-path takes the prefix of PREFIX.bin/PREFIX.idx)."),
    }[case]
    done = _torchrun(tmp_path, *argv)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("sdp4bit-pretrain:")]
    assert ours == [expected], done.stderr[-3000:]
    root_cause = done.stderr[done.stderr.index("Root Cause"):]
    assert f"traceback : {expected}" in root_cause, root_cause
    assert "exitcode  : 2" in root_cause
