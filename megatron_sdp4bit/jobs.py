"""Launching the package's torchrun jobs: command lines, their environment, a free port.

``make train``, the scripts and the tests start the driver (and the benchmarks'
ranks) through these, so a command line is written in one place:

- ``torchrun_command``: ``python -m torch.distributed.run`` for one node
  (``--standalone``) or one node of several (``NodeRendezvous``);
- ``driver_command`` / ``run_driver``: the pre-training driver as such a job, its
  console output in a log file next to its metrics (``Job``);
- ``job_env``: one thread per rank, Python's warnings off;
- ``free_port``, ``checkout_commit``.

Only the standard library is imported here.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

DRIVER = ("-m", "megatron_sdp4bit.pretrain")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it
    before it is bound: a caller that can, retries on EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class NodeRendezvous:
    """Where the nodes of a multi-node job meet: node ``node_rank`` of ``nnodes``."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def flags(self) -> List[str]:
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                "--master-addr", self.master_addr, "--master-port", str(self.master_port)]


def torchrun_command(nproc_per_node: int, entry: Sequence[str] = (), *,
                     rendezvous: Optional[NodeRendezvous] = None,
                     python: str = sys.executable) -> List[str]:
    """``python -m torch.distributed.run`` with ``nproc_per_node`` ranks on this node,
    then ``entry`` (``-m module args...`` or ``script args...``): ``--standalone``
    (one node, a free rendezvous port), or one node of ``rendezvous``."""
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    where = ["--standalone"] if rendezvous is None else rendezvous.flags()
    return [python, "-m", "torch.distributed.run", *where,
            f"--nproc-per-node={nproc_per_node}", *[str(arg) for arg in entry]]


def driver_command(flags: Sequence, ranks: int, python: str = sys.executable) -> List[str]:
    """The pre-training driver on ``ranks`` ranks of this node, with ``flags``."""
    return torchrun_command(ranks, [*DRIVER, *flags], python=python)


def job_env(**changes: str) -> dict:
    """This process's environment for a job's ranks: one thread per rank and Python's
    warnings off unless set already, then ``changes``. (The ranks import the package
    as this process does: installed, ``pip install -e`` in a checkout by ``make setup``.)"""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = os.environ.get("PYTHONWARNINGS", "ignore")
    env.update(changes)
    return env


@dataclass
class Job:
    """A finished driver job: its exit status, wall time and log file."""

    returncode: int
    seconds: float
    log_path: str

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


def run_driver(flags: Sequence, log_path: str, ranks: int = 4,
               timeout: Optional[float] = 4 * 3600, cwd: Optional[str] = None) -> Job:
    """``torchrun --nproc-per-node ranks -m megatron_sdp4bit.pretrain --no-progress-bar
    FLAGS`` in ``cwd``, its console output to ``log_path`` (started with the command);
    ``timeout`` seconds (None: no limit) before it is stopped."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    command = driver_command(["--no-progress-bar", *flags], ranks)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command[1:]) + "\n")
        log.flush()
        returncode = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT,
                                     env=job_env(), cwd=cwd, timeout=timeout)
    return Job(returncode, time.perf_counter() - started, log_path)


def checkout_commit(root: str, short: bool = False, mark_dirty: bool = False) -> str:
    """The commit ``root`` has checked out (``"unknown"`` outside git); ``mark_dirty``:
    ``+dirty`` appended when tracked files have uncommitted changes."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    head = git("rev-parse", *(["--short"] if short else []), "HEAD") or "unknown"
    if mark_dirty and git("status", "--porcelain", "--untracked-files=no"):
        head += "+dirty"
    return head
