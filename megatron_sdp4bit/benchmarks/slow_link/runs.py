"""One training run of ``scripts/bench_slow_link.py`` on the 2 x 2 emulated ranks, measured.

``run_once`` starts both nodes' torchrun jobs of the driver inside their network
namespaces and, while they train, reads the veth's byte counters when the last
warm-up step and the last step are logged; it returns the measured steps' times
and bytes (``RunResult``). ``Cell`` holds all runs of one (link rate, preset).

``args``: the script's command line (``--iters``, ``--warmup``, ``--python``,
``--dtype``, ``--probe``, ``--run-timeout``) and ``args.repo``, the checkout the
ranks run in.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_sdp4bit.benchmarks.emulated_nodes import (NAMESPACES, NUM_NODES, EmulatedNodes,
                                                        node_torchrun)
from megatron_sdp4bit.benchmarks.link_probes import probe_cpu
from megatron_sdp4bit.benchmarks.slow_link.presets import (DRIVER_ENTRY, PRESET_FLAGS,
                                                           RANKS_PER_NODE, dtype_flags,
                                                           model_flags)


@dataclass
class RunResult:
    """One training run's measured steps and bytes."""
    step_times: List[float]
    sent_per_step: float        # bytes rank 0 sent per step, as the driver accounts them
    sent_inter_per_step: float  # ... of which to the other node
    link_per_step: float        # bytes the veth carried per step, both directions
    load: float                 # 1-minute load average, mean of start and end
    cpu_share: Optional[float] = None  # cores one rank got (probe_cpu), mean of start and end
    # seconds per step rank 0's training thread waited on the overlapped reduce-scatters
    # and all-gathers (the driver's wait_*_s: the link wait overlap left exposed); medians
    waited_rs_per_step: float = 0.0
    waited_ag_per_step: float = 0.0


@dataclass
class Cell:
    """All runs of one (link rate, preset)."""
    runs: List[RunResult] = field(default_factory=list)

    def median_step(self) -> float:
        return statistics.median(t for r in self.runs for t in r.step_times)

    def fastest_step(self) -> float:
        """The least disturbed step: on a shared machine other jobs only ever add time."""
        return min(t for r in self.runs for t in r.step_times)

    def step(self, statistic: str) -> float:
        return self.median_step() if statistic == "median" else self.fastest_step()

    def run_medians(self) -> List[float]:
        return [statistics.median(r.step_times) for r in self.runs]

    def waited(self) -> tuple:
        """(reduce-scatter, all-gather) seconds per step rank 0 waited on the overlapped
        collectives, medians over the runs."""
        return (statistics.median(r.waited_rs_per_step for r in self.runs),
                statistics.median(r.waited_ag_per_step for r in self.runs))


def node_command(args, node: int, port: int, preset: str, run_dir: str) -> List[str]:
    """The full argv that starts ``node``'s two ranks inside its namespace."""
    entry = [*DRIVER_ENTRY, *model_flags(args.num_layers), *dtype_flags(args.dtype),
             *PRESET_FLAGS[preset], "--train-iters", str(args.iters), "--run-dir", run_dir]
    return node_torchrun(node, port, RANKS_PER_NODE, entry, args.python)


def train_rows(path: str) -> List[dict]:
    """The ``train`` rows a run has written completely to ``metrics.jsonl`` so far."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):  # a line still being written is read next time
                row = json.loads(line)
                if row.get("kind") == "train":
                    rows.append(row)
    return rows


def stop(procs: List[subprocess.Popen]) -> None:
    """Stop this run's processes: their process groups, then anything left in the namespaces."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for ns in NAMESPACES:  # only this benchmark starts processes in these namespaces
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _train_and_count(args, nodes: EmulatedNodes, preset: str, port: int, run_dir: str,
                     logs: List[str]) -> Dict[int, int]:
    """Run both nodes' jobs to the end; the veth byte counters at the logged iterations
    ``args.warmup`` (0: before the ranks start, so set-up included) and ``args.iters``."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    procs: List[subprocess.Popen] = []
    link_at: Dict[int, int] = {}
    try:
        for node in range(NUM_NODES):
            with open(logs[node], "w") as log:
                procs.append(subprocess.Popen(node_command(args, node, port, preset, run_dir),
                                              cwd=args.repo, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + args.run_timeout
        if not args.warmup:
            link_at[0] = sum(nodes.tx_bytes(k) for k in range(NUM_NODES))

        def read_counters_at_marks():
            done = {row["iteration"] for row in train_rows(metrics)}
            for it in (args.warmup, args.iters):
                if it in done and it not in link_at:
                    link_at[it] = sum(nodes.tx_bytes(k) for k in range(NUM_NODES))

        while any(p.poll() is None for p in procs):
            read_counters_at_marks()
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"run timed out after {args.run_timeout:.0f} s; logs: {logs}")
            time.sleep(0.1)
        read_counters_at_marks()  # a run that ended within one poll of its last step
        codes = [p.poll() for p in procs]
        if any(code != 0 for code in codes):
            raise RuntimeError(f"{preset} run failed (exit codes {codes}); last lines of "
                               f"{logs[0]}:\n{tail(logs[0])}\nlast lines of {logs[1]}:\n{tail(logs[1])}")
    finally:
        stop(procs)
    return link_at


def run_once(args, nodes: EmulatedNodes, preset: str, port: int, run_dir: str) -> RunResult:
    """Train ``args.iters`` steps on the 2 x 2 ranks; measure steps after the warm-up."""
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    logs = [os.path.join(run_dir, f"node{k}.log") for k in range(NUM_NODES)]
    load_start = os.getloadavg()[0]
    share_start = probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE) if args.probe == "on" else None
    # Read the veth counters when the warm-up's last step and the last step are
    # logged: the bytes in between are the measured steps' (to within one poll).
    link_at = _train_and_count(args, nodes, preset, port, run_dir, logs)
    rows = [r for r in train_rows(metrics) if r["iteration"] > args.warmup]
    if len(rows) != args.iters - args.warmup or args.iters not in link_at:
        raise RuntimeError(f"{metrics}: expected {args.iters - args.warmup} measured steps, "
                           f"found {len(rows)}")
    measured = len(rows)
    return RunResult(
        step_times=[r["step_time_s"] for r in rows],
        sent_per_step=statistics.median(r["bytes_sent"] for r in rows),
        sent_inter_per_step=statistics.median(r["bytes_sent_inter"] for r in rows),
        link_per_step=(link_at[args.iters] - link_at[args.warmup]) / measured,
        load=(load_start + os.getloadavg()[0]) / 2,
        waited_rs_per_step=statistics.median(r.get("wait_reduce_scatter_s") or 0.0 for r in rows),
        waited_ag_per_step=statistics.median(r.get("wait_all_gather_s") or 0.0 for r in rows),
        cpu_share=(None if share_start is None
                   else (share_start + probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE)) / 2),
    )
