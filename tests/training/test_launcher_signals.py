"""Real jobs stopped as users and schedulers stop them (issue 18 item 6, issue 28 item 3).

torchrun starts every rank in a session of its own: a signal to the job's process
group reaches torchrun only, which forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT
and, when a second signal reaches it during its shutdown, sends SIGTERM right
after the first. Each test starts a 2-rank torchrun job of the tiny model in a
process group of its own (as a shell or a scheduler does), waits until it trains,
stops it, and checks what is left: the checkpoint of the iteration it stopped at
(its files match its manifest), rank 0's one line, no rank still running, and
where said, that ``--load`` resumes from it.

- SIGTERM to the group (a scheduler's preemption), with ``--exit-signal-handler``.
- Ctrl-C: SIGINT to the group, then a second SIGINT to torchrun, which makes it
  send SIGTERM after SIGINT; no handler flag (``--save`` turns it on). Before:
  the SIGTERM killed the ranks, nothing saved.
- ``--exit-signal SIGUSR1`` sent to the group: torchrun does not handle SIGUSR1
  and dies of it. Before: the ranks trained on, detached, to the end.
- ``kill -9`` of the group: torchrun dies at once. Before: the ranks trained on
  as orphans, writing checkpoints; now they save and stop, or, without the
  handler, end at once, leaving the last complete checkpoint as it was.
- Ctrl-C to a plain single-process run (no launcher): saved, exit code 130.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from driver_runs import TINY_GPT
from megatron_sdp4bit.training.checkpoint import LATEST, check_files, read_manifest
from megatron_sdp4bit.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # real torchrun jobs

# fp32 and the distributed optimizer: the fastest resumable set-up on CPU
TINY = TINY_GPT + ["--lr-decay-iters", "100000", "--train-iters", "100000", "--use-distributed-optimizer"]
RANKS_GONE_S = 60  # a step, a save and the exit, on a loaded 2-core machine


def _env(tmp_path) -> dict:
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                SDP4BIT_CACHE=str(tmp_path / "cache"))


def _torchrun(*argv) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.1", "-m", "megatron_sdp4bit.pretrain", *TINY, *argv]


def _children(pid: int) -> list:
    """The pids of the processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


class Job:
    """A driver job in a process group of its own, its output in files."""

    def __init__(self, tmp_path, command: list, name: str = "job", ranks: int = 2):
        self.expected_ranks = ranks  # torchrun's children (0: a plain process)
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        self.metrics = tmp_path / name / "metrics.jsonl"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(command + ["--run-dir", str(tmp_path / name)], stdout=out,
                                         stderr=err, cwd=tmp_path, env=_env(tmp_path),
                                         start_new_session=True)
        self.ranks: list = []

    def wait_for_iteration(self, iteration: int, timeout_s: float = 600) -> None:
        """Until the log has ``iteration``; then the ranks' pids are known."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.metrics.is_file() and any(r["kind"] == "train" and r["iteration"] >= iteration
                                              for r in read_metrics(str(self.metrics))):
                self.ranks = _children(self.proc.pid)
                assert len(self.ranks) == self.expected_ranks, self.ranks
                return
            time.sleep(0.2)
        raise AssertionError(f"the job did not reach iteration {iteration}: {self.err.read_text()[-3000:]}")

    def wait_for(self, text: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.err.read_text():
            assert time.monotonic() < deadline, f"no {text!r} in: {self.err.read_text()[-3000:]}"
            time.sleep(0.02)

    def signal_group(self, signum: int) -> None:
        os.killpg(self.proc.pid, signum)

    def wait_for_ranks(self) -> float:
        """Seconds until torchrun and every rank have exited (at most ``RANKS_GONE_S``)."""
        start = time.monotonic()
        try:
            self.proc.wait(timeout=RANKS_GONE_S)
            while any(_running(pid) for pid in self.ranks):
                assert time.monotonic() - start < RANKS_GONE_S, f"ranks {self.ranks} still running"
                time.sleep(0.1)
        finally:
            for pid in [self.proc.pid, *self.ranks]:
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
        return time.monotonic() - start

    def our_lines(self) -> list:
        return [line for line in self.err.read_text().splitlines() if line.startswith("sdp4bit-pretrain:")]

    def logged(self) -> list:
        return [r["iteration"] for r in read_metrics(str(self.metrics)) if r["kind"] == "train"]


def _latest_checkpoint(ck, killed_saves: bool = False) -> int:
    """The tracker's iteration, after checking that checkpoint's files against its
    manifest. ``killed_saves``: a save the kill cut short may have left its
    ``iter_N.tmp`` (never loaded); otherwise there is none."""
    saved = int((ck / LATEST).read_text())
    directory = str(ck / f"iter_{saved:07d}")
    assert check_files(directory, read_manifest(directory)) == []
    assert killed_saves or not [name for name in os.listdir(ck) if name.endswith(".tmp")]
    return saved


def _resumes(tmp_path, ck, saved: int) -> None:
    resumed = subprocess.run(_torchrun("--train-iters", str(saved + 1), "--load", str(ck),
                                       "--run-dir", str(tmp_path / "resumed")),
                             capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ck} at iteration {saved}" in resumed.stdout


def _stopped_line(what: str, saved: int, ck) -> str:
    return (f"sdp4bit-pretrain: stopped: {what}: stopped after iteration {saved}, its checkpoint is saved "
            f"in {ck}; resume with --load {ck}")


def test_sigterm_to_a_torchrun_job_saves_and_the_job_resumes_from_it(tmp_path):
    ck = tmp_path / "ck"
    job = Job(tmp_path, _torchrun("--exit-signal-handler", "--save", str(ck), "--save-interval", "500"))
    job.wait_for_iteration(3)
    job.signal_group(signal.SIGTERM)
    seconds = job.wait_for_ranks()
    # within torchrun's grace period of 30 s (SIGKILL after it), or there would be no line
    print(f"the job ended {seconds:.1f} s after SIGTERM")
    assert job.proc.returncode != 0
    saved = _latest_checkpoint(ck)
    assert saved >= 3 and job.logged()[-1] == saved, (saved, job.logged())
    assert job.our_lines() == [_stopped_line("SIGTERM received", saved, ck)], job.err.read_text()[-3000:]
    _resumes(tmp_path, ck, saved)


def test_ctrl_c_twice_saves_once_under_the_handler_save_turns_on(tmp_path):
    """torchrun forwards SIGINT, then, as the second SIGINT reaches it, SIGTERM."""
    ck = tmp_path / "ck"
    job = Job(tmp_path, _torchrun("--save", str(ck), "--save-interval", "500"))
    job.wait_for_iteration(3)
    job.signal_group(signal.SIGINT)
    job.wait_for("closing signal SIGINT")
    os.kill(job.proc.pid, signal.SIGINT)
    job.wait_for_ranks()
    assert "closing signal SIGTERM" in job.err.read_text()  # what used to kill the ranks
    saved = _latest_checkpoint(ck)
    assert saved >= 3 and job.logged()[-1] == saved, (saved, job.logged())
    assert job.our_lines() == [_stopped_line("SIGINT received", saved, ck)], job.err.read_text()[-3000:]


@pytest.mark.parametrize("signum, flags", [
    (signal.SIGUSR1, ["--exit-signal", "SIGUSR1"]),  # torchrun dies of it: not among its signals
    (signal.SIGKILL, []),
], ids=["sigusr1", "kill-9"])
def test_a_launcher_that_dies_stops_its_ranks_which_save_first(tmp_path, signum, flags):
    ck = tmp_path / "ck"
    job = Job(tmp_path, _torchrun("--save", str(ck), "--save-interval", "500", *flags))
    job.wait_for_iteration(3)
    torchrun = job.proc.pid
    job.signal_group(signum)
    seconds = job.wait_for_ranks()
    print(f"the ranks ended {seconds:.1f} s after {signal.Signals(signum).name} killed torchrun")
    assert job.proc.returncode == -signum
    saved = _latest_checkpoint(ck)
    assert saved >= 3 and job.logged()[-1] == saved, (saved, job.logged())
    assert job.our_lines() == [_stopped_line(f"its launcher (torchrun, pid {torchrun}) exited", saved, ck)], (
        job.err.read_text()[-3000:])
    if signum == signal.SIGKILL:
        _resumes(tmp_path, ck, saved)


def test_without_the_handler_the_ranks_of_a_killed_launcher_end_at_once(tmp_path):
    """No save on the way out: the last complete checkpoint stays the latest, intact."""
    ck = tmp_path / "ck"
    job = Job(tmp_path, _torchrun("--no-exit-signal-handler", "--save", str(ck), "--save-interval", "2"))
    job.wait_for_iteration(5)
    job.signal_group(signal.SIGKILL)
    seconds = job.wait_for_ranks()
    print(f"the ranks ended {seconds:.1f} s after kill -9")
    assert seconds < 10, seconds
    saved = _latest_checkpoint(ck, killed_saves=True)
    assert saved >= 4 and saved % 2 == 0 and job.our_lines() == []


def test_a_hang_up_with_the_console_gone_still_saves(tmp_path):
    """An SSH session that drops under ``torchrun ... | tee log``: the reader of the
    job's output is gone (every print fails with EPIPE; a dead terminal's with EIO)
    and torchrun forwards SIGHUP. Before: the ranks died of SIGHUP, or of the
    BrokenPipeError of the log line before the save."""
    ck, metrics = tmp_path / "ck", tmp_path / "job" / "metrics.jsonl"
    proc = subprocess.Popen(_torchrun("--save", str(ck), "--run-dir", str(tmp_path / "job")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path, env=_env(tmp_path),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (metrics.is_file() and len(read_metrics(str(metrics))) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        ranks = _children(proc.pid)
        proc.stdout.close()  # the reader goes away
        os.killpg(proc.pid, signal.SIGHUP)
        proc.wait(timeout=RANKS_GONE_S)
        deadline = time.monotonic() + RANKS_GONE_S
        while any(_running(pid) for pid in ranks):
            assert time.monotonic() < deadline, f"ranks {ranks} still running"
            time.sleep(0.1)
    finally:
        for pid in [proc.pid, *_children(proc.pid)]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert len(ranks) == 2
    logged = [r["iteration"] for r in read_metrics(str(metrics)) if r["kind"] == "train"]
    assert _latest_checkpoint(ck) == logged[-1] >= 3


def test_ctrl_c_to_a_single_process_run_saves_and_exits_130(tmp_path):
    ck = tmp_path / "ck"
    job = Job(tmp_path, [sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, "--save", str(ck)], ranks=0)
    job.wait_for_iteration(3)
    job.signal_group(signal.SIGINT)
    job.wait_for_ranks()
    assert job.proc.returncode == 130, job.err.read_text()[-3000:]
    saved = _latest_checkpoint(ck)
    assert job.our_lines() == [_stopped_line("SIGINT received", saved, ck)]


@pytest.mark.parametrize("save", [False, True])
def test_ctrl_c_with_the_handler_off_is_one_line_not_a_traceback(tmp_path, save):
    """Without --save (or with --no-exit-signal-handler) Ctrl-C ends the run where it is;
    before, with Python's ``KeyboardInterrupt`` traceback (issue 28, round two)."""
    ck = tmp_path / "ck"
    flags = ["--save", str(ck), "--no-exit-signal-handler"] if save else []
    job = Job(tmp_path, [sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, *flags], ranks=0)
    job.wait_for_iteration(3)
    job.signal_group(signal.SIGINT)
    job.wait_for_ranks()
    assert job.proc.returncode == 130, job.err.read_text()[-3000:]
    assert "Traceback" not in job.err.read_text()
    assert job.our_lines() == [
        f"sdp4bit-pretrain: stopped: SIGINT received: stopped at once (--no-exit-signal-handler), nothing saved "
        f"since the latest checkpoint in {ck}; resume with --load {ck}" if save else
        "sdp4bit-pretrain: stopped: SIGINT received: stopped at once, nothing saved (no --save)"]
