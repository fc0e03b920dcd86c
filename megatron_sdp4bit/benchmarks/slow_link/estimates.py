"""``scripts/bench_slow_link.py``'s runs next to ``megatron_sdp4bit.estimate``.

``Probed`` is what the probes measured of the links (the estimator's link inputs
per rate); ``estimate_rows`` predicts every (rate, preset)'s step time from them,
compute calibrated once (the first preset with no limit, or ``--compute-s``), and
``estimate_table`` / ``print_estimate`` show prediction against measurement.

``args``: the script's command line (``--dtype``, ``--python``, ``--compute-s``,
``--calibrate``, ``--cpu-correction``, the rates and presets).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Dict, Optional

from megatron_sdp4bit.benchmarks.emulated_nodes import NUM_NODES
from megatron_sdp4bit.benchmarks.link_probes import probe_bytes, probe_goodput, probe_latency
from megatron_sdp4bit.benchmarks.slow_link.presets import (GLOBAL_BATCH, OVERLAP_BUCKET_SIZE,
                                                           PRESET_ESTIMATE, PRESET_LABELS,
                                                           RANKS_PER_NODE, STATISTICS,
                                                           base_preset, model_flags, overlapped,
                                                           rate_label)
from megatron_sdp4bit.benchmarks.slow_link.runs import Cell


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


def probe_link(args, probed: Probed, rate: Optional[float]) -> None:
    """Goodput and latency of the inter-node link at ``rate`` (it is set already)."""
    probed.goodput[rate] = probe_goodput(args.python, 0, 1, probe_bytes(rate))
    probed.latency_us[rate] = probe_latency(args.python, 0, 1)
    print(f"  node 0 -> node 1 (one TCP stream): goodput {probed.goodput[rate]:.3g} Gbit/s, "
          f"latency {probed.latency_us[rate]:.0f} us one way", flush=True)


def estimate_rows(args, cells: Dict[tuple, Cell], probed_links: Probed) -> dict:
    """The estimator's step time for every (rate, preset).

    Compute is calibrated on the first preset with no limit (or ``--compute-s``; the
    first preset is one without overlap, whose step is compute plus everything else).
    An ``-overlap`` preset is estimated with megatron's overlap of both directions and
    its buckets (the estimator hides what the schedule can, docs/performance.md).
    Every rank is taken to have cpu_count / ranks cores; with ``--cpu-correction``
    and runs that probed the CPU (``probe_cpu``), compute is taken as core-seconds
    of work, so a run whose ranks got less CPU (other jobs on the machine) is
    predicted proportionally slower, and the kernels are priced at the cores
    each run had. (The probe samples before and after a run, not during it: on
    a machine whose load comes in bursts it can miss by 2x.)
    """
    from megatron_sdp4bit.estimate.kernels import KernelModel
    from megatron_sdp4bit.estimate.gpt_shape import load_model_shape
    from megatron_sdp4bit.estimate.timing import Workload, estimate

    shape = load_model_shape(None, driver_argv=model_flags(args.num_layers))
    param_bytes = 2 if args.dtype == "bf16" else 4
    goodput = probed_links.goodput
    nominal = (os.cpu_count() or 1) / (NUM_NODES * RANKS_PER_NODE)

    def probed(cell) -> Optional[float]:
        shares = [r.cpu_share for r in cell.runs if r.cpu_share]
        return statistics.median(shares) if shares else None

    def share(cell) -> float:
        return (probed(cell) or nominal) if args.cpu_correction else nominal

    def step(rate, preset, cores, compute_s) -> float:  # the predicted step
        variant, exact, implementation = PRESET_ESTIMATE[base_preset(preset)]
        overlap = dict(overlap="full", bucket_size=OVERLAP_BUCKET_SIZE) if overlapped(preset) else {}
        work = Workload(shape=shape, global_batch=GLOBAL_BATCH, micro_batch=shape.micro_batch_size,
                        compute_s=compute_s, exact_reduce_scatter=exact,
                        param_element_size=param_bytes, implementation=implementation, **overlap)
        return estimate(probed_links.cluster(rate), work, KernelModel("cpu", cores_per_rank=cores),
                        ["baseline", variant] if variant != "baseline" else ["baseline"]
                        ).variants[variant].step_s

    def overhead(rate, preset, cores) -> float:  # predicted step minus compute (no overlap)
        return step(rate, preset, cores, 0.0)

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
            for statistic in STATISTICS:
                measured = cell.step(statistic)
                predicted = step(rate, preset, cores, out["compute_core_s"][statistic] / cores)
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
