"""A rank learns that its launcher died (launcher_watch.py), without torch or torchrun.

A stand-in launcher process starts a "rank" that calls ``watch_launcher`` as
torchrun's ranks do; the launcher is then killed with SIGKILL (it can forward
nothing): the rank receives the death signal and sees that its launcher exited. A
process no launcher started is not watched.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import megatron_sdp4bit
from megatron_sdp4bit.launcher_watch import DEATH_SIGNAL, watch_launcher

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron_sdp4bit.__file__)))
RANK = """
import signal, time
from megatron_sdp4bit.launcher_watch import DEATH_SIGNAL, watch_launcher
got = []
signal.signal(DEATH_SIGNAL, lambda signum, frame: got.append(signum))
launcher = watch_launcher({"TORCHELASTIC_RUN_ID": "test"})
print("watching", launcher.pid, flush=True)
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
print("got", got, "exited", launcher.exited(), flush=True)
"""
LAUNCHER = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]]).wait()"


def _wait_for(path, text: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_whose_launcher_is_killed_gets_the_death_signal_and_sees_it_exited(tmp_path):
    out = tmp_path / "rank.out"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)  # the package this test imports
    with open(out, "w") as f:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], stdout=f, env=env)
    try:
        assert f"watching {launcher.pid}" in _wait_for(out, "watching")
        launcher.kill()
        launcher.wait()
        assert _wait_for(out, "got").splitlines()[-1] == f"got [{DEATH_SIGNAL}] exited True"
    finally:
        launcher.kill()


def test_a_process_no_launcher_started_is_not_watched():
    assert watch_launcher({}) is None
