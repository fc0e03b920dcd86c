#!/usr/bin/env python
"""End-to-end training speed, SDP4Bit vs the exact collectives, over an emulated slow link.

Runs the pre-training driver as 2 emulated nodes x 2 CPU ranks: each node is a
network namespace, the two joined by a veth pair whose both directions are
rate-limited with ``tc tbf`` (``scripts/netns_nodes.py``). Ranks of one node
talk over the namespace's loopback (fast); ranks of different nodes over the
limited veth (the "inter-node link"). Each node runs

    ip netns exec sdp4bit-nK env GLOO_SOCKET_IFNAME=sdp4bit-vK python -m torch.distributed.run \\
        --nnodes 2 --node-rank K --nproc-per-node 2 --master-addr 10.77.0.1 --master-port P \\
        -m megatron_sdp4bit.pretrain <small GPT flags> <preset flags>

For every link rate (``loopback`` = no limit) and preset the runs are
interleaved (baseline, sdp4bit, baseline, sdp4bit, ...) so load changes on a
shared machine hit both. Per (rate, preset) it reports the median step time over
all measured steps of all repeats (the first ``--warmup`` steps of each run are
skipped), tokens/s, the bytes the driver accounts per rank and step, the bytes
the veth actually carried per step (kernel counters, both directions), and the
speedup over the exact collectives at the same rate. Prints a markdown table
and the command that produced it.

Needs root and iproute2; the namespaces are removed at the end, on errors and
on Ctrl-C. Nothing talks to any address outside the two namespaces.

    sudo .venv/bin/python scripts/bench_slow_link.py                       # loopback, 1000, 100 Mbit/s
    sudo .venv/bin/python scripts/bench_slow_link.py --rates 100 --repeats 3 --presets baseline,sdp4bit,zeropp
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from netns_nodes import (ADDRESSES, NAMESPACES, VETHS, EmulatedNodes,  # noqa: E402
                         SetupError, check_host)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS_PER_NODE = 2
NUM_NODES = 2
GLOBAL_BATCH, SEQ_LENGTH = 16, 128
LR_WARMUP_ITERS = 2  # megatron's scheduler needs more training iterations than this
# The `make train` model (5.3 M params) on the embedded corpus; no evaluation
# until the end (one batch), so every logged step is a training step.
MODEL_FLAGS = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", str(SEQ_LENGTH), "--micro-batch-size", "4",
    "--global-batch-size", str(GLOBAL_BATCH), "--bf16",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", str(LR_WARMUP_ITERS),
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--split", "969,30,1",
    "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--no-progress-bar",
]
PRESET_FLAGS = {
    "baseline": ["--sdp4bit-preset", "baseline", "--use-distributed-optimizer"],
    "sdp4bit": ["--sdp4bit"],
    "zeropp": ["--sdp4bit-preset", "zeropp"],
}
PRESET_LABELS = {"baseline": "exact (bf16 all-gather, fp32 reduce-scatter)",
                 "sdp4bit": "SDP4Bit (qWD 4-bit, TLq-HS 8/4)",
                 "zeropp": "ZeRO++ (qW 4-bit, ULq 4/4)"}
FIRST_PORT = 29600  # inside the private namespaces every port is free


@dataclass
class RunResult:
    """One training run's measured steps and bytes."""
    step_times: List[float]
    sent_per_step: float        # bytes rank 0 sent per step, as the driver accounts them
    sent_inter_per_step: float  # ... of which to the other node
    link_per_step: float        # bytes the veth carried per step, both directions
    load: float                 # 1-minute load average, mean of start and end


@dataclass
class Cell:
    """All runs of one (link rate, preset)."""
    runs: List[RunResult] = field(default_factory=list)

    def median_step(self) -> float:
        return statistics.median(t for r in self.runs for t in r.step_times)

    def run_medians(self) -> List[float]:
        return [statistics.median(r.step_times) for r in self.runs]


# --- arguments ------------------------------------------------------------------------

def parse_rates(text: str) -> List[Optional[float]]:
    """``"loopback,1000,100"`` -> ``[None, 1000.0, 100.0]`` (Mbit/s; None = no limit)."""
    rates: List[Optional[float]] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in ("loopback", "none", "unlimited"):
            rates.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--rates: {item!r} is neither a rate in Mbit/s nor 'loopback'") from None
        if value <= 0:
            raise ValueError(f"--rates: {item!r} must be a positive rate in Mbit/s (or 'loopback')")
        rates.append(value)
    return rates


def rate_label(rate: Optional[float]) -> str:
    return "no limit (veth)" if rate is None else f"{rate:g} Mbit/s"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="loopback,1000,100",
                   help="comma-separated link rates in Mbit/s per direction; 'loopback' = no limit")
    p.add_argument("--presets", default="baseline,sdp4bit",
                   help=f"comma-separated, the first is the reference: {', '.join(PRESET_FLAGS)}")
    p.add_argument("--repeats", type=int, default=2, help="runs per (rate, preset), interleaved")
    p.add_argument("--iters", type=int, default=16, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=4, help="first iterations of a run not measured")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="one-way delay added with netem (needs the sch_netem kernel module)")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a run is killed")
    p.add_argument("--out-dir", default=None, help="where run logs go (default runs/slow-link-TIME)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    args = p.parse_args(argv)
    try:
        args.rate_list = parse_rates(args.rates)
    except ValueError as exc:
        p.error(str(exc))
    args.preset_list = [s.strip() for s in args.presets.split(",") if s.strip()]
    unknown = [s for s in args.preset_list if s not in PRESET_FLAGS]
    if unknown or not args.preset_list:
        p.error(f"--presets: unknown {unknown}; choose from {', '.join(PRESET_FLAGS)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.iters <= LR_WARMUP_ITERS:
        p.error(f"--iters must be above {LR_WARMUP_ITERS} (the runs' learning-rate warm-up)")
    if not 0 <= args.warmup < args.iters:
        p.error(f"--warmup ({args.warmup}) must be >= 0 and below --iters ({args.iters})")
    return args


# --- one run --------------------------------------------------------------------------

def node_command(args, node: int, port: int, preset: str, run_dir: str) -> List[str]:
    """The full argv that starts ``node``'s two ranks inside its namespace."""
    env = [f"GLOO_SOCKET_IFNAME={VETHS[node]}", "OMP_NUM_THREADS=1", "PYTHONWARNINGS=ignore"]
    return [*EmulatedNodes.exec_prefix(node), "env", *env,
            args.python, "-m", "torch.distributed.run",
            "--nnodes", str(NUM_NODES), "--node-rank", str(node),
            "--nproc-per-node", str(RANKS_PER_NODE),
            "--master-addr", ADDRESSES[0], "--master-port", str(port),
            "-m", "megatron_sdp4bit.pretrain", *MODEL_FLAGS, *PRESET_FLAGS[preset],
            "--train-iters", str(args.iters), "--run-dir", run_dir]


def _train_rows(path: str) -> List[dict]:
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


def _stop(procs: List[subprocess.Popen]) -> None:
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
    for ns in NAMESPACES:  # only this script starts processes in these namespaces
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in pids.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def run_once(args, nodes: EmulatedNodes, preset: str, port: int, run_dir: str) -> RunResult:
    """Train ``args.iters`` steps on the 2 x 2 ranks; measure steps after the warm-up."""
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    logs = [os.path.join(run_dir, f"node{k}.log") for k in range(NUM_NODES)]
    load_start = os.getloadavg()[0]
    procs: List[subprocess.Popen] = []
    link_at: Dict[int, int] = {}
    try:
        for node in range(NUM_NODES):
            with open(logs[node], "w") as log:
                procs.append(subprocess.Popen(node_command(args, node, port, preset, run_dir),
                                              cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + args.run_timeout
        # Read the veth counters when the warm-up's last step and the last step are
        # logged: the bytes in between are the measured steps' (to within one poll).
        # With no warm-up the count starts before the ranks do, so it includes set-up.
        if not args.warmup:
            link_at[0] = sum(nodes.tx_bytes(k) for k in range(NUM_NODES))

        def read_counters_at_marks():
            done = {row["iteration"] for row in _train_rows(metrics)}
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
                               f"{logs[0]}:\n{_tail(logs[0])}\nlast lines of {logs[1]}:\n{_tail(logs[1])}")
    finally:
        _stop(procs)
    rows = [r for r in _train_rows(metrics) if r["iteration"] > args.warmup]
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
    )


# --- the table ------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown_table(args, cells: Dict[tuple, Cell]) -> str:
    reference = args.preset_list[0]
    head = ("| link (each direction) | collectives | median step s | run medians s | tokens/s "
            f"| speedup vs {reference} | MiB sent/rank/step (to other node) "
            "| MiB over link/step (measured) | load avg |")
    lines = [head, "|" + "---|" * 2 + "---:|" * 7]
    for rate in args.rate_list:
        ref_step = cells[(rate, reference)].median_step()
        for preset in args.preset_list:
            cell = cells[(rate, preset)]
            step = cell.median_step()
            runs = cell.runs
            sent = statistics.median(r.sent_per_step for r in runs)
            inter = statistics.median(r.sent_inter_per_step for r in runs)
            link = statistics.median(r.link_per_step for r in runs)
            lines.append(
                f"| {rate_label(rate)} | {PRESET_LABELS[preset]} | {step:.3f} "
                f"| {', '.join(f'{m:.2f}' for m in cell.run_medians())} "
                f"| {GLOBAL_BATCH * SEQ_LENGTH / step:,.0f} | {ref_step / step:.2f}x "
                f"| {_mib(sent)} ({_mib(inter)}) | {_mib(link)} "
                f"| {statistics.median(r.load for r in runs):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_host()
    except SetupError as exc:
        print(f"bench_slow_link: {exc}", file=sys.stderr)
        return 2
    # SIGTERM/SIGHUP take the same path as Ctrl-C (and SIGINT is reinstalled, since a
    # shell ignores it for background jobs), so the namespaces are always removed.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    out_dir = os.path.abspath(args.out_dir or os.path.join(
        REPO, "runs", "slow-link-" + time.strftime("%Y%m%d-%H%M%S")))
    command = " ".join(["sudo .venv/bin/python scripts/bench_slow_link.py"] + [
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])
    cells = {(rate, preset): Cell() for rate in args.rate_list for preset in args.preset_list}
    port = FIRST_PORT
    t0 = time.monotonic()
    try:
        with EmulatedNodes(delay_ms=args.delay_ms) as nodes:
            for repeat in range(args.repeats):
                for rate in args.rate_list:
                    nodes.set_link(rate)
                    if repeat == 0:
                        print(f"link {rate_label(rate)}: {nodes.describe_link() or 'no qdisc'}",
                              flush=True)
                    for preset in args.preset_list:
                        run_dir = os.path.join(out_dir, f"{'loopback' if rate is None else f'{rate:g}mbit'}"
                                                        f"-{preset}-{repeat}")
                        result = run_once(args, nodes, preset, port, run_dir)
                        port += 1
                        cells[(rate, preset)].runs.append(result)
                        print(f"[{time.monotonic() - t0:6.0f} s] repeat {repeat + 1}/{args.repeats} "
                              f"{rate_label(rate):>16} {preset:>8}: median step "
                              f"{statistics.median(result.step_times):.3f} s, link "
                              f"{_mib(result.link_per_step)} MiB/step, load {result.load:.1f}",
                              flush=True)
    except (SetupError, RuntimeError) as exc:
        print(f"bench_slow_link: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench_slow_link: interrupted; namespaces removed", file=sys.stderr)
        return 130
    print()
    print(markdown_table(args, cells))
    print()
    print(f"{NUM_NODES} emulated nodes x {RANKS_PER_NODE} gloo CPU ranks; GPT 4 layers x 256 "
          f"(5.3 M params), global batch {GLOBAL_BATCH} x {SEQ_LENGTH} tokens, bf16; "
          f"{args.iters} iterations per run, first {args.warmup} not measured, {args.repeats} "
          f"interleaved runs per row; tbf on both veth ends"
          + (f", netem delay {args.delay_ms:g} ms" if args.delay_ms else "")
          + f"; {os.cpu_count()} CPUs; total {time.monotonic() - t0:.0f} s.")
    print(f"command: {command}")
    print(f"logs: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
