"""``scripts/bench_slow_link.py``'s study: every (link rate, preset), interleaved, measured.

For every link rate (``None`` = no limit) and preset the runs are interleaved
(baseline, sdp4bit, baseline, sdp4bit, ...) so load changes on a shared machine
hit both; before the runs of each rate its link is probed (goodput, latency).
``run_study`` then prints the table, writes ``--json`` (the measurements before
the estimator runs) and, with ``--estimate``, the estimator's comparison.

``args``: the script's command line (``parse_args``) and ``args.repo``, the checkout.
"""
from __future__ import annotations

import itertools
import os
import signal
import statistics
import sys
import time
from typing import Dict, Iterator

from megatron_sdp4bit.benchmarks.emulated_nodes import NUM_NODES, EmulatedNodes, SetupError
from megatron_sdp4bit.benchmarks.link_probes import probe_bytes, probe_goodput, probe_latency
from megatron_sdp4bit.benchmarks.slow_link.estimates import (Probed, estimate_rows, print_estimate,
                                                             probe_link)
from megatron_sdp4bit.benchmarks.slow_link.presets import (FIRST_PORT, GLOBAL_BATCH,
                                                           RANKS_PER_NODE, SEQ_LENGTH,
                                                           model_flags, rate_label)
from megatron_sdp4bit.benchmarks.slow_link.report import (markdown_table, mib, overlap_table,
                                                          write_json)
from megatron_sdp4bit.benchmarks.slow_link.runs import Cell, run_once


def _calibrate(args, nodes, probed: Probed, cells: Dict[tuple, Cell], ports: Iterator[int],
               out_dir: str, t0: float) -> None:
    """``--calibrate``: the first preset once with no limit (where compute is calibrated)."""
    nodes.set_link(None)
    probe_link(args, probed, None)
    reference = args.preset_list[0]
    result = run_once(args, nodes, reference, next(ports),
                      os.path.join(out_dir, f"calibration-{reference}"))
    cells[(None, reference)] = Cell([result])
    print(f"[{time.monotonic() - t0:6.0f} s] calibration, no limit (goodput "
          f"{probed.goodput[None]:.3g} Gbit/s), {reference}: median step "
          f"{statistics.median(result.step_times):.3f} s, load {result.load:.1f}", flush=True)


def _measure(args, nodes, probed: Probed, cells: Dict[tuple, Cell], ports: Iterator[int],
             out_dir: str, t0: float) -> None:
    """Every repeat of every (rate, preset), the presets interleaved within each rate."""
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
                result = run_once(args, nodes, preset, next(ports), run_dir)
                cells[(rate, preset)].runs.append(result)
                print(f"[{time.monotonic() - t0:6.0f} s] repeat {repeat + 1}/{args.repeats} "
                      f"{rate_label(rate):>16} {preset:>8}: median step "
                      f"{statistics.median(result.step_times):.3f} s, link "
                      f"{mib(result.link_per_step)} MiB/step, load {result.load:.1f}",
                      flush=True)


def _train_everything(args, cells: Dict[tuple, Cell], probed: Probed, out_dir: str,
                      t0: float) -> None:
    with EmulatedNodes(delay_ms=args.delay_ms) as nodes:
        nodes.set_slow_start_after_idle(args.slow_start_after_idle)
        if args.probe == "on":
            probed.loopback_gbps = probe_goodput(args.python, 0, 0, probe_bytes(None))
            probed.loopback_latency_us = probe_latency(args.python, 0, 0)
            print(f"node loopback (one TCP stream): goodput {probed.loopback_gbps:.3g} "
                  f"Gbit/s, latency {probed.loopback_latency_us:.0f} us one way", flush=True)
        ports = itertools.count(FIRST_PORT)  # a fresh rendezvous port for every run
        if args.calibrate:
            _calibrate(args, nodes, probed, cells, ports, out_dir, t0)
        _measure(args, nodes, probed, cells, ports, out_dir, t0)


def run_study(args, command: str) -> int:
    """Train every (rate, preset) ``args.repeats`` times; print and write the results.
    Exit status: 0, 2 (the host cannot, or a run failed), 130 (interrupted)."""
    # SIGTERM/SIGHUP take the same path as Ctrl-C (and SIGINT is reinstalled, since a
    # shell ignores it for background jobs), so the namespaces are always removed.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    out_dir = os.path.abspath(args.out_dir or os.path.join(
        args.repo, "runs", "slow-link-" + time.strftime("%Y%m%d-%H%M%S")))
    cells = {(rate, preset): Cell() for rate in args.rate_list for preset in args.preset_list}
    probed = Probed(0.0, {})
    t0 = time.monotonic()
    try:
        _train_everything(args, cells, probed, out_dir, t0)
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
    overlap = overlap_table(args, cells, est)
    if overlap:  # the overlap study: what each preset's link wait leaves exposed
        print(overlap)
        print()
    _print_footer(args, command, out_dir, time.monotonic() - t0)
    return 0


def _print_footer(args, command: str, out_dir: str, seconds: float) -> None:
    from megatron_sdp4bit.estimate.gpt_shape import load_model_shape, total_params

    shape = load_model_shape(None, driver_argv=model_flags(args.num_layers))
    print(f"{NUM_NODES} emulated nodes x {RANKS_PER_NODE} gloo CPU ranks; GPT {shape.num_layers} "
          f"layers x {shape.hidden_size} ({total_params(shape) / 1e6:.1f} M params), global "
          f"batch {GLOBAL_BATCH} x {SEQ_LENGTH} tokens, {args.dtype}; "
          f"{args.iters} iterations per run, first {args.warmup} not measured, {args.repeats} "
          f"interleaved runs per row; tbf on both veth ends"
          + (f", netem delay {args.delay_ms:g} ms" if args.delay_ms else "")
          + f", tcp_slow_start_after_idle={args.slow_start_after_idle}"
          + f"; {os.cpu_count()} CPUs; total {seconds:.0f} s.")
    print(f"command: {command}")
    print(f"logs: {out_dir}")
    if args.json:
        print(f"json: {args.json}")
