#!/usr/bin/env python
"""End-to-end training speed, SDP4Bit vs the exact collectives, over an emulated slow link.

Runs the pre-training driver as 2 emulated nodes x 2 CPU ranks: each node is a
network namespace, the two joined by a veth pair whose both directions are
rate-limited with ``tc tbf`` (``megatron_sdp4bit.benchmarks.emulated_nodes``).
Ranks of one node talk over the namespace's loopback (fast); ranks of different
nodes over the limited veth (the "inter-node link"). Each node runs

    ip netns exec sdp4bit-nK env GLOO_SOCKET_IFNAME=sdp4bit-vK SDP4BIT_HOST_ID=sdp4bit-nK python -m torch.distributed.run \\
        --nnodes 2 --node-rank K --master-addr 10.77.0.1 --master-port P --nproc-per-node=2 \\
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
ping-pong their one-way latency (``--probe``,
``megatron_sdp4bit.benchmarks.link_probes``).
With ``--estimate``, the measured step times are compared with
``megatron_sdp4bit.estimate`` at those goodputs and latencies (per message;
gloo's per-call cost is not measured): compute per step is calibrated once,
from the first preset at ``loopback`` (its measured step minus the
estimator's communication and kernel time there), and every other (rate,
preset) is predicted from it. ``--json FILE`` writes every number (the
measurements before the estimator runs).

Needs root and iproute2; the namespaces are removed at the end, on errors and
on Ctrl-C. Nothing talks to any address outside the two namespaces. Run
``make setup`` first (the package, installed editable, is what this runs:
``megatron_sdp4bit.benchmarks.slow_link``).

    sudo .venv/bin/python scripts/bench_slow_link.py                       # loopback, 1000, 100 Mbit/s
    sudo .venv/bin/python scripts/bench_slow_link.py --rates 100 --repeats 3 --presets baseline,sdp4bit,zeropp
    sudo .venv/bin/python scripts/bench_slow_link.py --rates loopback,300 --presets baseline-a2a,baseline,sdp4bit --estimate
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import List, Optional

from megatron_sdp4bit.benchmarks.emulated_nodes import SetupError, check_host
from megatron_sdp4bit.benchmarks.slow_link.collectives_alone import run_collectives
from megatron_sdp4bit.benchmarks.slow_link.presets import LR_WARMUP_ITERS, NUM_LAYERS, PRESET_FLAGS
from megatron_sdp4bit.benchmarks.slow_link.report import replay
from megatron_sdp4bit.benchmarks.slow_link.study import run_study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="loopback,1000,100",
                   help="comma-separated link rates in Mbit/s per direction; 'loopback' = no limit")
    p.add_argument("--presets", default="baseline,sdp4bit",
                   help=f"comma-separated, the first is the reference: {', '.join(PRESET_FLAGS)}")
    p.add_argument("--repeats", type=int, default=2, help="runs per (rate, preset), interleaved")
    p.add_argument("--num-layers", type=int, default=NUM_LAYERS,
                   help=f"layers of the model (default {NUM_LAYERS}: `make train`'s); more layers put "
                        "a smaller share of the bytes in the embedding bucket, which overlap "
                        "cannot hide")
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
    if args.num_layers < 1:
        p.error(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.iters <= LR_WARMUP_ITERS:
        p.error(f"--iters must be above {LR_WARMUP_ITERS} (the runs' learning-rate warm-up)")
    if not 0 <= args.warmup < args.iters:
        p.error(f"--warmup ({args.warmup}) must be >= 0 and below --iters ({args.iters})")
    if args.estimate and (args.probe == "off" or (None not in args.rate_list and not args.calibrate
                                                  and args.compute_s is None)):
        p.error("--estimate needs --probe on, and 'loopback' in --rates or --calibrate (compute "
                "is calibrated with no limit) or --compute-s")
    if args.estimate and args.compute_s is None and args.preset_list[0].endswith("-overlap"):
        p.error(f"--estimate calibrates compute on the first preset, which must not overlap: "
                f"put {args.preset_list[0][:-len('-overlap')]} (or another preset) first")
    if args.calibrate and (not args.estimate or args.compute_s is not None
                           or None in args.rate_list):
        p.error("--calibrate needs --estimate, no --compute-s and no 'loopback' in --rates")
    if args.compute_s is not None and not args.compute_s > 0:
        p.error(f"--compute-s must be positive, got {args.compute_s}")
    args.repo = ROOT
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replay:
        return replay(args)
    try:
        check_host()
        if args.collectives:
            return run_collectives(args)
    except (SetupError, RuntimeError) as exc:
        print(f"bench_slow_link: {exc}", file=sys.stderr)
        return 2
    command = " ".join(["sudo .venv/bin/python scripts/bench_slow_link.py"]
                       + [shlex.quote(a) for a in argv])
    return run_study(args, command)


if __name__ == "__main__":
    sys.exit(main())
