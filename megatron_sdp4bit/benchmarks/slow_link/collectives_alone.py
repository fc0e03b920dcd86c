"""``scripts/bench_slow_link.py --collectives``: the collectives alone at each link rate.

The model's one gradient bucket, every case of ``benchmarks.collectives.PRESETS``
(each preset's reduce-scatter and weight all-gather, and the two exact
reduce-scatters) timed on the 2 x 2 emulated ranks (the one collective benchmark,
run by torchrun inside the namespaces), next to the estimator's prediction of
each at the link's probed goodput and latency.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Optional

from megatron_sdp4bit.benchmarks import collectives
from megatron_sdp4bit.benchmarks.emulated_nodes import NUM_NODES, EmulatedNodes, node_torchrun
from megatron_sdp4bit.benchmarks.link_probes import (probe_bytes, probe_cpu, probe_goodput,
                                                     probe_latency)
from megatron_sdp4bit.benchmarks.slow_link.estimates import Probed
from megatron_sdp4bit.benchmarks.slow_link.presets import (FIRST_PORT, GLOBAL_BATCH,
                                                           RANKS_PER_NODE, model_flags,
                                                           rate_label)

# How the estimator prices each way of calling a collective (its exact reduce-scatter).
EXACT_ALGORITHM = {"alltoall": "alltoall", "torch": "allreduce", "layer": "ring"}


def bench_bucket(num_layers: int) -> int:
    """Elements of the model's one gradient bucket on 4 DP ranks (megatron's layout)."""
    from megatron_sdp4bit.estimate.gpt_shape import bucket_numels, load_model_shape, stage_params

    shape = load_model_shape(None, driver_argv=model_flags(num_layers))
    (numel,) = bucket_numels(stage_params(shape, 1, 1, 0), NUM_NODES * RANKS_PER_NODE, None)
    return numel


def predictions(dtype: str, cluster, cores: float, num_layers: int) -> Dict[str, float]:
    """The estimator's seconds for each case on ``cluster`` (``Probed.cluster``): link time,
    latency and that collective's kernels."""
    from megatron_sdp4bit.estimate.kernels import KernelModel
    from megatron_sdp4bit.estimate.gpt_shape import load_model_shape
    from megatron_sdp4bit.estimate.timing import Workload, estimate

    shape = load_model_shape(None, driver_argv=model_flags(num_layers))
    kernels = KernelModel("cpu", cores_per_rank=cores)
    out = {}
    for case in collectives.PRESETS:
        work = Workload(shape=shape, global_batch=GLOBAL_BATCH, micro_batch=shape.micro_batch_size,
                        compute_s=0.0, exact_reduce_scatter=EXACT_ALGORITHM[case.call],
                        param_element_size=2 if dtype == "bf16" else 4)
        v = estimate(cluster, work, kernels).variants[case.config]
        prefix = "grad_" if case.kind == "rs" else "weight_"
        kernel_s = sum(sec for op, sec in v.kernel_ops.items() if op.startswith(prefix))
        out[case.label] = (v.grad_comm_s if case.kind == "rs" else v.weight_comm_s) + kernel_s
    return out


def measure(args, numel: int, port: int) -> tuple:
    """``(seconds of every case, or None if the job printed none; node 0's output)`` on
    the emulated ranks (the link set already)."""
    entry = ["-m", collectives.__name__, "--cases", "presets", "--numel", str(numel),
             "--dtype", args.dtype, "--repeats", str(args.iters),
             "--ranks-per-node", str(RANKS_PER_NODE)]
    procs = [subprocess.Popen(node_torchrun(node, port, RANKS_PER_NODE, entry, args.python),
                              cwd=args.repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for node in range(NUM_NODES)]
    outputs = [proc.communicate(timeout=args.run_timeout)[0] for proc in procs]
    rows = collectives.read_rows("\n".join(outputs))
    seconds: Optional[Dict[str, float]] = (None if rows is None else
                                           {row["label"]: row["seconds"] for row in rows})
    return seconds, outputs[0]


def run_collectives(args) -> int:
    """Measure and predict every case at each rate of ``args.rate_list``; print the table."""
    numel = bench_bucket(args.num_layers)
    rows = []
    with EmulatedNodes(delay_ms=args.delay_ms) as nodes:
        nodes.set_slow_start_after_idle(args.slow_start_after_idle)
        probed = Probed(probe_goodput(args.python, 0, 0, probe_bytes(None)), {},
                        probe_latency(args.python, 0, 0))
        for index, rate in enumerate(args.rate_list):
            nodes.set_link(rate)
            goodput = probed.goodput[rate] = probe_goodput(args.python, 0, 1, probe_bytes(rate))
            probed.latency_us[rate] = probe_latency(args.python, 0, 1)
            share = probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE)
            measured, output = measure(args, numel, FIRST_PORT + index)
            if measured is None:
                print(f"bench_slow_link: collectives failed at {rate_label(rate)}:\n"
                      + output[-2000:], file=sys.stderr)
                return 2
            share = (share + probe_cpu(args.python, NUM_NODES, RANKS_PER_NODE)) / 2
            nominal = (os.cpu_count() or 1) / (NUM_NODES * RANKS_PER_NODE)
            predicted = predictions(args.dtype, probed.cluster(rate),
                                    share if args.cpu_correction else nominal, args.num_layers)
            load = os.getloadavg()[0]
            rows += [(rate, goodput, share, case.label, measured[case.label],
                      predicted[case.label], load) for case in collectives.PRESETS]
            print(f"[{rate_label(rate)}: goodput {goodput:.3g} Gbit/s, latency "
                  f"{probed.latency_us[rate]:.0f} us one way (loopback "
                  f"{probed.loopback_latency_us:.0f}), {share:.2f} cores per rank, load "
                  f"{load:.1f}]", flush=True)
    print_table(args, numel, probed.loopback_gbps, rows)
    return 0


def print_table(args, numel: int, loopback_gbps: float, rows: list) -> None:
    print()
    print(f"One gradient bucket of {numel:,} fp32 elements ({args.dtype} weights), 2 x 2 ranks, "
          f"median of {args.iters} calls (slowest rank); node loopback {loopback_gbps:.3g} Gbit/s; "
          f"kernels priced at {'the probed' if args.cpu_correction else 'cpu_count / ranks'} "
          "cores per rank:")
    print()
    print("| link (goodput, Gbit/s) | cores/rank probed | collective | measured s | predicted s "
          "| error | load |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for rate, goodput, share, name, m, pred, load in rows:
        print(f"| {rate_label(rate)} ({goodput:.3g}) | {share:.2f} | {name} | {m:.3f} | {pred:.3f} "
              f"| {100 * (pred / m - 1):+.0f}% | {load:.1f} |")
