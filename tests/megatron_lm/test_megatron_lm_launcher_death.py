"""A rank of the Megatron-LM route does not outlive its torchrun (issue 28 item 3).

``torchrun -m megatron_sdp4bit.launch SCRIPT``, 2 ranks, SCRIPT a stand-in for
``pretrain_gpt.py`` that only beats; ``kill -9`` of the job's process group kills
torchrun, which cannot forward anything, and every rank must end within seconds
(Megatron-LM's own handler knows one signal, so the death signal's default action
ends the rank). Before, the ranks ran on as orphans to the end of their script.

Needs ``megatron.training`` importable (the launcher wraps its parser first): the
megatron-core 0.19.2 wheel ships it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

BEAT = """
import os, time
for _ in range(3000):  # 5 minutes
    print("beat", os.getpid(), flush=True)
    time.sleep(0.1)
"""


def _megatron_training_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        return False


def _children(pid: int) -> list:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's")
@pytest.mark.skipif(not _megatron_training_importable(),
                    reason="megatron.training is not importable here (make test MCORE=0.19.2)")
def test_kill_9_of_torchrun_ends_the_ranks_of_the_megatron_lm_launcher(tmp_path):
    script = tmp_path / "pretrain_beat.py"
    script.write_text(BEAT)
    out = tmp_path / "job.out"
    with open(out, "w") as f:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", "2", "-m", "megatron_sdp4bit.launch", str(script)],
                               stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    ranks = []
    try:
        deadline = time.monotonic() + 300
        while out.read_text().count("beat") < 4:  # both ranks in the script
            assert time.monotonic() < deadline and job.poll() is None, out.read_text()[-3000:]
            time.sleep(0.2)
        ranks = _children(job.pid)
        assert len(ranks) == 2, ranks
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in ranks):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived torchrun"
            time.sleep(0.1)
    finally:
        for pid in [job.pid, *ranks]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
