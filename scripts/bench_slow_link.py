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

Presets: ``baseline`` (exact collectives; gloo's reduce_scatter is a ring
*all-reduce*, twice a ring reduce-scatter's bytes), ``baseline-a2a`` (exact,
with the reduce-scatter as an all-to-all plus local sum,
``comm/exact_alltoall.py``, the driver's ``--sdp4bit-exact-reduce-scatter alltoall``:
the bytes per rank of a ring reduce-scatter), ``sdp4bit``, ``zeropp``.

Before the runs of each rate, a single TCP stream measures the goodput of the
inter-node link (node 0 -> node 1) and of a node's loopback, and a 1-byte
ping-pong their one-way latency (``--probe``, ``scripts/link_probes.py``).
With ``--estimate``, the measured step times are compared with
``megatron_sdp4bit.estimate`` at those goodputs and latencies (per message;
gloo's per-call cost is not measured): compute per step is calibrated once,
from the first preset at ``loopback`` (its measured step minus the
estimator's communication and kernel time there), and every other (rate,
preset) is predicted from it. ``--json FILE`` writes every number (the
measurements before the estimator runs).

Needs root and iproute2; the namespaces are removed at the end, on errors and
on Ctrl-C. Nothing talks to any address outside the two namespaces.

    sudo .venv/bin/python scripts/bench_slow_link.py                       # loopback, 1000, 100 Mbit/s
    sudo .venv/bin/python scripts/bench_slow_link.py --rates 100 --repeats 3 --presets baseline,sdp4bit,zeropp
    sudo .venv/bin/python scripts/bench_slow_link.py --rates loopback,300 --presets baseline-a2a,baseline,sdp4bit --estimate
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

from link_probes import probe_bytes, probe_cpu, probe_goodput, probe_latency  # noqa: E402
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
    "--global-batch-size", str(GLOBAL_BATCH),
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", str(LR_WARMUP_ITERS),
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--split", "969,30,1",
    "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--no-progress-bar",
]
PRESET_FLAGS = {
    "baseline": ["--sdp4bit-preset", "baseline", "--use-distributed-optimizer"],
    "baseline-a2a": ["--sdp4bit-preset", "baseline", "--use-distributed-optimizer",
                     "--sdp4bit-exact-reduce-scatter", "alltoall"],
    "sdp4bit": ["--sdp4bit"],
    "zeropp": ["--sdp4bit-preset", "zeropp"],
}
PRESET_LABELS = {"baseline": "exact (gloo reduce_scatter, fp32)",
                 "baseline-a2a": "exact, reduce-scatter as all-to-all (fp32)",
                 "sdp4bit": "SDP4Bit (qWD 4-bit, TLq-HS 8/4)",
                 "zeropp": "ZeRO++ (qW 4-bit, ULq 4/4)"}
DRIVER_ENTRY = ["-m", "megatron_sdp4bit.pretrain"]  # what each rank runs
# How the estimator sees each preset: (variant, exact reduce-scatter algorithm).
PRESET_ESTIMATE = {"baseline": ("baseline", "allreduce"), "baseline-a2a": ("baseline", "alltoall"),
                   "sdp4bit": ("sdp4bit", "ring"), "zeropp": ("zeropp", "ring")}
STATISTICS = ("median", "fastest")  # step statistics compared with the estimator
FIRST_PORT = 29600  # inside the private namespaces every port is free


@dataclass
class Probed:
    """What the probes measured of the links: the estimator's link inputs per rate."""
    loopback_gbps: float
    goodput: Dict[Optional[float], float]            # rate (None: no limit) -> Gbit/s
    loopback_latency_us: float = 0.0                 # one way; 0: not measured (older files)
    latency_us: Dict[Optional[float], float] = field(default_factory=dict)

    def cluster(self, rate: Optional[float]):
        """The estimator's view of the 2 x 2 emulated nodes at ``rate``: one TCP stream's
        goodput per link, the ping-pong latency per traversal (gloo's per-call and per-message
        costs unmeasured: 0)."""
        from megatron_sdp4bit.estimate.network import Latency
        from megatron_sdp4bit.estimate.timing import Cluster

        latency = Latency(0.0, self.loopback_latency_us, self.latency_us.get(rate, 0.0), 0.0)
        return Cluster(NUM_NODES, RANKS_PER_NODE, 1, 1, self.loopback_gbps, self.goodput[rate],
                       latency=latency)


@dataclass
class RunResult:
    """One training run's measured steps and bytes."""
    step_times: List[float]
    sent_per_step: float        # bytes rank 0 sent per step, as the driver accounts them
    sent_inter_per_step: float  # ... of which to the other node
    link_per_step: float        # bytes the veth carried per step, both directions
    load: float                 # 1-minute load average, mean of start and end
    cpu_share: Optional[float] = None  # cores one rank got (probe_cpu), mean of start and end


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
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="model weights (gradients are reduced in fp32 either way); fp32 on CPUs "
                        "without native bf16 matmuls (AVX2 only), where bf16 steps take seconds")
    p.add_argument("--slow-start-after-idle", choices=("0", "1"), default="1",
                   help="the namespaces' net.ipv4.tcp_slow_start_after_idle (kernel default 1): 0 "
                        "keeps TCP's window between a step's messages, as RDMA links have none")
    p.add_argument("--probe", choices=("on", "off"), default="on",
                   help="measure each link's single-stream TCP goodput before its runs")
    p.add_argument("--estimate", action="store_true",
                   help="compare with megatron_sdp4bit.estimate (needs --probe on and 'loopback' "
                        "in --rates, where compute is calibrated on the first preset)")
    p.add_argument("--calibrate", action="store_true",
                   help="--estimate: first run the first preset once with no limit, to calibrate "
                        "compute (instead of needing 'loopback' in --rates)")
    p.add_argument("--cpu-correction", action="store_true",
                   help="--estimate: scale compute and kernels by the cores per rank the CPU probe "
                        "measured around each run (default: every rank has cpu_count / ranks)")
    p.add_argument("--compute-s", type=float, default=None,
                   help="--estimate: compute seconds per step (e.g. calibrated by an earlier run) "
                        "instead of calibrating at loopback")
    p.add_argument("--json", default=None, help="write every measured number to this file")
    p.add_argument("--collectives", action="store_true",
                   help="time the collectives alone (the model's gradient bucket, no training) at "
                        "each rate, next to the estimator's prediction for each")
    p.add_argument("--replay", default=None, metavar="JSON",
                   help="run nothing: print the tables and the estimator comparison of a file "
                        "written by --json (rates, presets and dtype come from the file)")
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
    if args.estimate and (args.probe == "off" or (None not in args.rate_list and not args.calibrate
                                                  and args.compute_s is None)):
        p.error("--estimate needs --probe on, and 'loopback' in --rates or --calibrate (compute "
                "is calibrated with no limit) or --compute-s")
    if args.calibrate and (not args.estimate or args.compute_s is not None
                           or None in args.rate_list):
        p.error("--calibrate needs --estimate, no --compute-s and no 'loopback' in --rates")
    if args.compute_s is not None and not args.compute_s > 0:
        p.error(f"--compute-s must be positive, got {args.compute_s}")
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
            *DRIVER_ENTRY, *MODEL_FLAGS, *dtype_flags(args),
            *PRESET_FLAGS[preset],
            "--train-iters", str(args.iters), "--run-dir", run_dir]


def dtype_flags(args) -> List[str]:
    return ["--bf16"] if args.dtype == "bf16" else []


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
    share_start = probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE) if args.probe == "on" else None
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
        cpu_share=(None if share_start is None
                   else (share_start + probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE)) / 2),
    )


# --- the estimator --------------------------------------------------------------------

def probe_link(args, probed: Probed, rate: Optional[float]) -> None:
    """Goodput and latency of the inter-node link at ``rate`` (it is set already)."""
    probed.goodput[rate] = probe_goodput(args.python, 0, 1, probe_bytes(rate))
    probed.latency_us[rate] = probe_latency(args.python, 0, 1)
    print(f"  node 0 -> node 1 (one TCP stream): goodput {probed.goodput[rate]:.3g} Gbit/s, "
          f"latency {probed.latency_us[rate]:.0f} us one way", flush=True)


def estimate_rows(args, cells: Dict[tuple, "Cell"], probed_links: Probed) -> dict:
    """The estimator's step time for every (rate, preset).

    Compute is calibrated on the first preset with no limit (or ``--compute-s``).
    Every rank is taken to have cpu_count / ranks cores; with ``--cpu-correction``
    and runs that probed the CPU (``probe_cpu``), compute is taken as core-seconds
    of work, so a run whose ranks got less CPU (other jobs on the machine) is
    predicted proportionally slower, and the kernels are priced at the cores
    each run had. (The probe samples before and after a run, not during it: on
    a machine whose load comes in bursts it can miss by 2x.)
    """
    from megatron_sdp4bit.estimate.kernels import KernelModel
    from megatron_sdp4bit.estimate.model import load_model_shape
    from megatron_sdp4bit.estimate.timing import Workload, estimate

    shape = load_model_shape(None, driver_argv=MODEL_FLAGS)
    param_bytes = 2 if args.dtype == "bf16" else 4
    goodput = probed_links.goodput
    nominal = (os.cpu_count() or 1) / (NUM_NODES * RANKS_PER_NODE)

    def probed(cell) -> Optional[float]:
        shares = [r.cpu_share for r in cell.runs if r.cpu_share]
        return statistics.median(shares) if shares else None

    def share(cell) -> float:
        return (probed(cell) or nominal) if args.cpu_correction else nominal

    def overhead(rate, preset, cores) -> float:  # predicted step minus compute
        variant, exact = PRESET_ESTIMATE[preset]
        work = Workload(shape=shape, global_batch=GLOBAL_BATCH, micro_batch=shape.micro_batch_size,
                        compute_s=0.0, exact_reduce_scatter=exact, param_element_size=param_bytes)
        return estimate(probed_links.cluster(rate), work, KernelModel("cpu", cores_per_rank=cores),
                        ["baseline", variant] if variant != "baseline" else ["baseline"]
                        ).variants[variant].step_s

    reference = args.preset_list[0]
    calibrating = args.compute_s is None
    ref_share = share(cells[(None, reference)]) if calibrating else nominal
    out = {"loopback_gbps": probed_links.loopback_gbps, "calibration_cpu_share": ref_share,
           "calibration_probed_cpu_share": probed(cells[(None, reference)]) if calibrating else None,
           "compute_core_s": {}, "rows": []}
    for statistic in STATISTICS:
        # compute work in core-seconds: given, or the no-limit run of the first preset
        seconds = (args.compute_s if not calibrating else cells[(None, reference)].step(statistic)
                   - overhead(None, reference, ref_share))
        out["compute_core_s"][statistic] = seconds * ref_share
    for rate in args.rate_list:
        for preset in args.preset_list:
            cell = cells[(rate, preset)]
            cores = share(cell)
            row = {"rate": rate, "preset": preset, "goodput_gbps": goodput[rate],
                   "latency_us": probed_links.latency_us.get(rate),
                   "cpu_share": cores, "probed_cpu_share": probed(cell),
                   "calibration": rate is None and preset == reference and calibrating}
            rest = overhead(rate, preset, cores)
            for statistic in STATISTICS:
                measured = cell.step(statistic)
                predicted = out["compute_core_s"][statistic] / cores + rest
                row[statistic] = {"measured_s": measured, "predicted_s": predicted,
                                  "error": predicted / measured - 1}
            out["rows"].append(row)
    return out


def _share(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def estimate_table(args, est: dict) -> str:
    reference = args.preset_list[0]
    by = {(r["rate"], r["preset"]): r for r in est["rows"]}
    lines = ["| link (goodput, Gbit/s) | collectives | cores/rank (probed) | median step s | predicted "
             "| error | fastest step s | predicted | error "
             f"| speedup vs {reference}, median (predicted) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rate in args.rate_list:
        ref = by[(rate, reference)]
        for preset in args.preset_list:
            r = by[(rate, preset)]
            cells = []
            for statistic in STATISTICS:
                m = r[statistic]
                error = "calibration" if r["calibration"] else f"{100 * m['error']:+.0f}%"
                cells.append(f"{m['measured_s']:.3f} | {m['predicted_s']:.3f} | {error}")
            med, ref_med = r["median"], ref["median"]
            lines.append(
                f"| {rate_label(rate)} ({r['goodput_gbps']:.3g}) | {PRESET_LABELS[preset]} "
                f"| {r['cpu_share']:.2f} ({_share(r['probed_cpu_share'])}) | {' | '.join(cells)} | {ref_med['measured_s'] / med['measured_s']:.2f}x "
                f"({ref_med['predicted_s'] / med['predicted_s']:.2f}x) |")
    return "\n".join(lines)


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


# --- the collectives alone -------------------------------------------------------------

COLLECTIVE_CASES = (  # (name, variant, kind, exact reduce-scatter algorithm)
    ("exact reduce-scatter, all-to-all (fp32)", "baseline", "rs", "alltoall"),
    ("exact reduce-scatter, gloo (fp32)", "baseline", "rs", "allreduce"),
    ("exact all-gather", "baseline", "ag", "ring"),
    ("SDP4Bit reduce-scatter (TLq-HS 8/4)", "sdp4bit", "rs", "ring"),
    ("SDP4Bit all-gather (qWD 4-bit)", "sdp4bit", "ag", "ring"),
    ("ZeRO++ reduce-scatter (ULq 4/4)", "zeropp", "rs", "ring"),
    ("ZeRO++ all-gather (qW 4-bit)", "zeropp", "ag", "ring"),
)


def _bench_bucket(args) -> int:
    """Elements of the model's one gradient bucket on 4 DP ranks (megatron's layout)."""
    from megatron_sdp4bit.estimate.model import bucket_numels, load_model_shape, stage_params

    shape = load_model_shape(None, driver_argv=MODEL_FLAGS)
    (numel,) = bucket_numels(stage_params(shape, 1, 1, 0), NUM_NODES * RANKS_PER_NODE, None)
    return numel


def collective_worker(numel: int, dtype: str, reps: int) -> None:
    """One rank of ``--collectives`` (run by torchrun): time every case, print from rank 0."""
    import torch
    import torch.distributed as dist

    from megatron_sdp4bit.comm import quantized_all_gather_weights, quantized_reduce_scatter
    from megatron_sdp4bit.comm.exact_alltoall import alltoall_reduce_scatter
    from megatron_sdp4bit.config import preset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shard = numel // world
    grads, out = torch.randn(numel), torch.empty(shard)
    model = torch.zeros(numel, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    main = torch.randn(shard) * 1e-3
    configs = {v: preset(v, ranks_per_node=RANKS_PER_NODE) for v in ("baseline", "sdp4bit", "zeropp")}
    calls = {
        "exact reduce-scatter, all-to-all (fp32)": lambda: alltoall_reduce_scatter(out, grads),
        "exact reduce-scatter, gloo (fp32)": lambda: dist.reduce_scatter_tensor(out, grads),
    }
    for name, variant, kind, _ in COLLECTIVE_CASES:
        config = configs[variant]
        if kind == "ag":
            calls[name] = (lambda c=config: quantized_all_gather_weights(model, main, config=c))
        elif variant != "baseline":
            calls[name] = (lambda c=config: quantized_reduce_scatter(
                out, grads, op=dist.ReduceOp.AVG, config=c))
    result = {}
    for name, *_ in COLLECTIVE_CASES:
        calls[name]()  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        result[name] = float(slowest)
    if dist.get_rank() == 0:
        print("COLLECTIVES " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def collective_predictions(args, numel: int, cluster, cores: float) -> Dict:
    """The estimator's seconds for each case on ``cluster`` (``Probed.cluster``): link time,
    latency and that collective's kernels."""
    from megatron_sdp4bit.estimate.kernels import KernelModel
    from megatron_sdp4bit.estimate.model import load_model_shape
    from megatron_sdp4bit.estimate.timing import Workload, estimate

    shape = load_model_shape(None, driver_argv=MODEL_FLAGS)
    kernels = KernelModel("cpu", cores_per_rank=cores)
    out = {}
    for name, variant, kind, exact in COLLECTIVE_CASES:
        work = Workload(shape=shape, global_batch=GLOBAL_BATCH, micro_batch=shape.micro_batch_size,
                        compute_s=0.0, exact_reduce_scatter=exact,
                        param_element_size=2 if args.dtype == "bf16" else 4)
        v = estimate(cluster, work, kernels).variants[variant]
        prefix = "grad_" if kind == "rs" else "weight_"
        kernel_s = sum(sec for op, sec in v.kernel_ops.items() if op.startswith(prefix))
        out[name] = (v.grad_comm_s if kind == "rs" else v.weight_comm_s) + kernel_s
    return out


def run_collectives(args) -> int:
    """``--collectives``: the collectives alone at each rate, measured and predicted."""
    numel = _bench_bucket(args)
    rows = []
    port = FIRST_PORT
    with EmulatedNodes(delay_ms=args.delay_ms) as nodes:
        for ns in NAMESPACES:
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                            f"net.ipv4.tcp_slow_start_after_idle={args.slow_start_after_idle}"],
                           check=True)
        probed = Probed(probe_goodput(args.python, 0, 0, probe_bytes(None)), {},
                        probe_latency(args.python, 0, 0))
        loopback = probed.loopback_gbps
        for rate in args.rate_list:
            nodes.set_link(rate)
            goodput = probed.goodput[rate] = probe_goodput(args.python, 0, 1, probe_bytes(rate))
            probed.latency_us[rate] = probe_latency(args.python, 0, 1)
            share = probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE)
            procs = []
            for node in range(NUM_NODES):
                cmd = [*EmulatedNodes.exec_prefix(node), "env", f"GLOO_SOCKET_IFNAME={VETHS[node]}",
                       "OMP_NUM_THREADS=1", "PYTHONWARNINGS=ignore", args.python, "-m",
                       "torch.distributed.run", "--nnodes", str(NUM_NODES), "--node-rank", str(node),
                       "--nproc-per-node", str(RANKS_PER_NODE), "--master-addr", ADDRESSES[0],
                       "--master-port", str(port), os.path.abspath(__file__), "--collective-worker",
                       str(numel), args.dtype, str(args.iters)]
                procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
            port += 1
            outputs = [proc.communicate(timeout=args.run_timeout)[0] for proc in procs]
            lines = [ln for out in outputs for ln in out.splitlines() if ln.startswith("COLLECTIVES ")]
            if not lines:
                print(f"bench_slow_link: collectives failed at {rate_label(rate)}:\n"
                      + outputs[0][-2000:], file=sys.stderr)
                return 2
            measured = json.loads(lines[0].split(" ", 1)[1])
            share = (share + probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE)) / 2
            nominal = (os.cpu_count() or 1) / (NUM_NODES * RANKS_PER_NODE)
            predicted = collective_predictions(args, numel, probed.cluster(rate),
                                               share if args.cpu_correction else nominal)
            load = os.getloadavg()[0]
            for name, *_ in COLLECTIVE_CASES:
                rows.append((rate, goodput, share, name, measured[name], predicted[name], load))
            print(f"[{rate_label(rate)}: goodput {goodput:.3g} Gbit/s, latency "
                  f"{probed.latency_us[rate]:.0f} us one way (loopback "
                  f"{probed.loopback_latency_us:.0f}), {share:.2f} cores per rank, load "
                  f"{load:.1f}]", flush=True)
    print()
    print(f"One gradient bucket of {numel:,} fp32 elements ({args.dtype} weights), 2 x 2 ranks, "
          f"median of {args.iters} calls (slowest rank); node loopback {loopback:.3g} Gbit/s; "
          f"kernels priced at {'the probed' if args.cpu_correction else 'cpu_count / ranks'} "
          "cores per rank:")
    print()
    print("| link (goodput, Gbit/s) | cores/rank probed | collective | measured s | predicted s "
          "| error | load |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for rate, goodput, share, name, m, pred, load in rows:
        print(f"| {rate_label(rate)} ({goodput:.3g}) | {share:.2f} | {name} | {m:.3f} | {pred:.3f} "
              f"| {100 * (pred / m - 1):+.0f}% | {load:.1f} |")
    return 0


def replay(args) -> int:
    """Tables and estimator comparison of a ``--json`` file, without running anything."""
    with open(args.replay, encoding="utf-8") as f:
        data = json.load(f)
    command = data["command"].split()
    args.dtype = command[command.index("--dtype") + 1] if "--dtype" in command else "bf16"
    cells: Dict[tuple, Cell] = {}
    for c in data["cells"]:
        runs = c.get("runs") or [{"step_times": c["step_times"], "sent_per_step": c["sent_per_step"][0],
                                  "sent_inter_per_step": c["sent_inter_per_step"][0],
                                  "link_per_step": c["link_per_step"][0], "load": c["load"][0]}]
        cells[(c["rate"], c["preset"])] = Cell([RunResult(**run) for run in runs])
    args.preset_list = list(dict.fromkeys(preset for _, preset in cells))
    grid = [rate for rate in dict.fromkeys(rate for rate, _ in cells)
            if all((rate, preset) in cells for preset in args.preset_list)]
    args.rate_list, args.calibrate = grid, (None, args.preset_list[0]) in cells and None not in grid
    args.compute_s = None
    rates = list(dict.fromkeys(rate for rate, _ in cells))
    latency = data.get("latency_us") or {}  # files written before the latency probe: none
    probed = Probed(data["loopback_goodput_gbps"],
                    {rate: data["goodput_gbps"][rate_label(rate)] for rate in rates},
                    data.get("loopback_latency_us") or 0.0,
                    {rate: latency[rate_label(rate)] for rate in rates if rate_label(rate) in latency})
    print(f"replay of {args.replay} ({data['command']})")
    print()
    print(markdown_table(args, cells))
    print()
    print_estimate(args, cells, estimate_rows(args, cells, probed))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--collective-worker"]:  # one rank of --collectives, under torchrun
        collective_worker(int(argv[1]), argv[2], int(argv[3]))
        return 0
    args = parse_args(argv)
    if args.replay:
        return replay(args)
    if args.collectives:
        try:
            check_host()
            return run_collectives(args)
        except (SetupError, RuntimeError) as exc:
            print(f"bench_slow_link: {exc}", file=sys.stderr)
            return 2
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
    probed = Probed(0.0, {})
    port = FIRST_PORT
    t0 = time.monotonic()
    try:
        with EmulatedNodes(delay_ms=args.delay_ms) as nodes:
            for ns in NAMESPACES:
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                                f"net.ipv4.tcp_slow_start_after_idle={args.slow_start_after_idle}"],
                               check=True)
            if args.probe == "on":
                probed.loopback_gbps = probe_goodput(args.python, 0, 0, probe_bytes(None))
                probed.loopback_latency_us = probe_latency(args.python, 0, 0)
                print(f"node loopback (one TCP stream): goodput {probed.loopback_gbps:.3g} "
                      f"Gbit/s, latency {probed.loopback_latency_us:.0f} us one way", flush=True)
            if args.calibrate:
                nodes.set_link(None)
                probe_link(args, probed, None)
                reference = args.preset_list[0]
                result = run_once(args, nodes, reference, port,
                                  os.path.join(out_dir, f"calibration-{reference}"))
                port += 1
                cells[(None, reference)] = Cell([result])
                print(f"[{time.monotonic() - t0:6.0f} s] calibration, no limit (goodput "
                      f"{probed.goodput[None]:.3g} Gbit/s), {reference}: median step "
                      f"{statistics.median(result.step_times):.3f} s, load {result.load:.1f}",
                      flush=True)
            for repeat in range(args.repeats):
                for rate in args.rate_list:
                    nodes.set_link(rate)
                    if repeat == 0:
                        print(f"link {rate_label(rate)}: {nodes.describe_link() or 'no qdisc'}",
                              flush=True)
                        if args.probe == "on":
                            probe_link(args, probed, rate)
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
    if args.json:  # the measurements first: nothing below can lose them
        write_json(args.json, command, probed, cells, None)
    est = estimate_rows(args, cells, probed) if args.estimate else None
    if est is not None:
        print_estimate(args, cells, est)
        if args.json:
            write_json(args.json, command, probed, cells, est)
    print(f"{NUM_NODES} emulated nodes x {RANKS_PER_NODE} gloo CPU ranks; GPT 4 layers x 256 "
          f"(5.3 M params), global batch {GLOBAL_BATCH} x {SEQ_LENGTH} tokens, {args.dtype}; "
          f"{args.iters} iterations per run, first {args.warmup} not measured, {args.repeats} "
          f"interleaved runs per row; tbf on both veth ends"
          + (f", netem delay {args.delay_ms:g} ms" if args.delay_ms else "")
          + f", tcp_slow_start_after_idle={args.slow_start_after_idle}"
          + f"; {os.cpu_count()} CPUs; total {time.monotonic() - t0:.0f} s.")
    print(f"command: {command}")
    print(f"logs: {out_dir}")
    if args.json:
        print(f"json: {args.json}")
    return 0


def print_estimate(args, cells: Dict[tuple, Cell], est: dict) -> None:
    where = ("given (--compute-s)" if args.compute_s is not None
             else f"calibrated on {args.preset_list[0]} at no limit")
    print(f"Estimator (megatron_sdp4bit.estimate) at the measured goodputs and latencies"
          f"{' and CPU shares' if args.cpu_correction else ''}; "
          f"compute {est['compute_core_s']['median']:.3f} core-s (median) / "
          f"{est['compute_core_s']['fastest']:.3f} core-s (fastest step) per rank and step "
          f"{where}; kernels: CPU table at the cores per rank shown:")
    print()
    print(estimate_table(args, est))
    print()
    if args.calibrate:
        cal = cells[(None, args.preset_list[0])]
        print(f"Calibration run (no limit, {args.preset_list[0]}): median step "
              f"{cal.median_step():.3f} s, fastest {cal.fastest_step():.3f} s, load "
              f"{cal.runs[0].load:.1f}, cores per rank probed "
              f"{_share(est['calibration_probed_cpu_share'])}.")
        print()


def write_json(path: str, command: str, probed: Probed, cells: Dict[tuple, Cell],
               est: Optional[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"command": command, "loopback_goodput_gbps": probed.loopback_gbps,
                   "goodput_gbps": {rate_label(r): g for r, g in probed.goodput.items()},
                   "loopback_latency_us": probed.loopback_latency_us,
                   "latency_us": {rate_label(r): u for r, u in probed.latency_us.items()},
                   "cells": [{"rate": rate, "preset": preset,
                              "step_times": [t for r in cell.runs for t in r.step_times],
                              "median_step_s": cell.median_step(),
                              "run_medians_s": cell.run_medians(),
                              "sent_per_step": [r.sent_per_step for r in cell.runs],
                              "sent_inter_per_step": [r.sent_inter_per_step for r in cell.runs],
                              "link_per_step": [r.link_per_step for r in cell.runs],
                              "load": [r.load for r in cell.runs],
                              "runs": [vars(r) for r in cell.runs]}
                             for (rate, preset), cell in cells.items()],
                   "estimate": est}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
