"""Run the pre-training driver as a torchrun job of CPU ranks, for the long scripts.

``scripts/soak.py`` and ``scripts/reproduce_accuracy.py`` launch many driver runs
one after another; this is the one place that knows how: the command line, the
environment (one thread per rank, the package importable from a checkout), and
where each job's output goes. Every job's console output is written to a log
file next to its metrics, so a failed run can be read afterwards.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Job:
    returncode: int
    seconds: float
    log_path: str

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


def driver_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore"),
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}


def run_driver(flags: list, log_path: str, ranks: int = 4, timeout: float = 4 * 3600) -> Job:
    """``torchrun --nproc-per-node ranks -m megatron_sdp4bit.pretrain FLAGS``; output to ``log_path``."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", "-m", "megatron_sdp4bit.pretrain",
               "--no-progress-bar", *[str(f) for f in flags]]
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command[1:]) + "\n")
        log.flush()
        returncode = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT,
                                     env=driver_env(), cwd=ROOT, timeout=timeout)
    return Job(returncode, time.perf_counter() - started, log_path)


def prepare_corpus(max_mb=None) -> str:
    """The embedded corpus, built once into the cache every job then reads."""
    from megatron_sdp4bit.data import prepare_default_corpus

    return prepare_default_corpus(max_mb=max_mb)
