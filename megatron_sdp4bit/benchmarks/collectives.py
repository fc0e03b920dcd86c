"""Time and bytes of collectives on this process group: the one collective benchmark.

Run on every rank of a torchrun job (``scripts/bench_collectives.py`` starts one on
this machine's CPU ranks, ``scripts/bench_slow_link.py --collectives`` one over two
emulated nodes)::

    python -m megatron_sdp4bit.benchmarks.collectives --cases variants|presets \\
        --numel N [--repeats R] [--ranks-per-node 2] [--dtype bf16|fp32] \
        [--backend gloo|nccl|auto]

``--backend`` (``diagnostics/world.py``; default gloo, the CPU ranks of the published
tables): with nccl the buffers are on each rank's own GPU and each call is timed
until its kernels end.

Each case is one collective call on one bucket of ``numel`` elements (random fp32
gradients, a model buffer and this rank's fp32 main shard): a warm-up call (which
also builds the topology), one call whose bytes ``get_wire_stats`` records, then
``repeats`` timed calls, each started after a barrier and taken at its slowest
rank (a collective ends there); the median of those is the case's time. Rank 0
prints one line, ``COLLECTIVES`` and the rows as JSON (``read_rows`` finds it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

MARK = "COLLECTIVES "
LEVELS = ("intra", "inter")


@dataclass(frozen=True)
class Case:
    """One collective call: the layer's (``config``: ``SDP4BitConfig`` fields or a preset
    name), the all-to-all exact reduce-scatter (``call="alltoall"``) or torch's own
    (``call="torch"``)."""

    label: str
    kind: str  # "rs" (reduce-scatter) or "ag" (weight all-gather)
    config: object = None  # dict of SDP4BitConfig fields, or a preset name
    call: str = "layer"
    op: str = "sum"  # the reduce-scatter's op: "sum" or "avg"


VARIANTS = (  # scripts/bench_collectives.py, in table order; the first of each kind is exact
    Case("exact reduce-scatter (fp32)", "rs", dict(grad_mode="off")),
    Case("TLq-HS 8/4 g128 (paper)", "rs", dict(grad_mode="tlq-hs")),
    Case("TLq-HS 8/4, 4 pipeline chunks", "rs", dict(grad_mode="tlq-hs", pipeline_chunks=4)),
    Case("TLq 8/4 (no Hadamard)", "rs", dict(grad_mode="tlq")),
    Case("ULq 4/4 (ZeRO++ qgZ)", "rs", dict(grad_mode="ulq")),
    Case("exact all-gather (bf16)", "ag", dict(weight_mode="off")),
    Case("qWD 4-bit g2048 (paper)", "ag", dict(weight_mode="diff")),
    Case("qW 4-bit g2048 (ZeRO++ qwZ)", "ag", dict(weight_mode="direct")),
)
PRESETS = (  # scripts/bench_slow_link.py --collectives: each preset's two collectives
    Case("exact reduce-scatter, all-to-all (fp32)", "rs", "baseline", call="alltoall"),
    Case("exact reduce-scatter, gloo (fp32)", "rs", "baseline", call="torch"),
    Case("exact all-gather", "ag", "baseline"),
    Case("SDP4Bit reduce-scatter (TLq-HS 8/4)", "rs", "sdp4bit", op="avg"),
    Case("SDP4Bit all-gather (qWD 4-bit)", "ag", "sdp4bit"),
    Case("ZeRO++ reduce-scatter (ULq 4/4)", "rs", "zeropp", op="avg"),
    Case("ZeRO++ all-gather (qW 4-bit)", "ag", "zeropp"),
)
CASE_SETS = {"variants": VARIANTS, "presets": PRESETS}


def _config(case: Case, ranks_per_node: int):
    from megatron_sdp4bit.config import SDP4BitConfig, preset

    if isinstance(case.config, str):
        return preset(case.config, ranks_per_node=ranks_per_node)
    return SDP4BitConfig(ranks_per_node=ranks_per_node, **(case.config or {}))


def _buffers(numel: int, dtype: str, device=None) -> dict:
    """This rank's inputs: its gradients, the (replicated) model buffer, its main shard,
    on ``device`` (default CPU)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = numel // world
    gen = torch.Generator().manual_seed(rank)
    model = torch.randn(world * shard, generator=torch.Generator().manual_seed(0))
    buffers = {"grads": torch.randn(world * shard, generator=gen), "grad_out": torch.empty(shard),
               "model": model.to(torch.bfloat16 if dtype == "bf16" else torch.float32),
               "main": model[rank * shard:(rank + 1) * shard] + 1e-3 * torch.randn(shard,
                                                                                     generator=gen)}
    return {name: t.to(device) for name, t in buffers.items()} if device is not None else buffers


def make_call(case: Case, buffers: dict, ranks_per_node: int) -> Callable[[], None]:
    """The case's collective on ``buffers``, as a function of no arguments."""
    import torch.distributed as dist

    from megatron_sdp4bit.comm import quantized_all_gather_weights, quantized_reduce_scatter
    from megatron_sdp4bit.comm.exact_alltoall import alltoall_reduce_scatter

    out, grads = buffers["grad_out"], buffers["grads"]
    if case.call == "alltoall":
        return lambda: alltoall_reduce_scatter(out, grads)
    if case.call == "torch":
        return lambda: dist.reduce_scatter_tensor(out, grads)
    config = _config(case, ranks_per_node)
    if case.kind == "ag":
        return lambda: quantized_all_gather_weights(buffers["model"], buffers["main"],
                                                    config=config)
    op = dist.ReduceOp.AVG if case.op == "avg" else dist.ReduceOp.SUM
    return lambda: quantized_reduce_scatter(out, grads, op=op, config=config)


def time_call(call: Callable[[], None], repeats: int, device=None) -> float:
    """Median over ``repeats`` of one call's seconds on its slowest rank (on a CUDA
    ``device``, until its kernels end: NCCL and the Triton kernels return early)."""
    import torch
    import torch.distributed as dist

    cuda = device is not None and device.type == "cuda"
    times = []
    for _ in range(repeats):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times)


def _bytes(kind: str) -> dict:
    """This rank's bytes of the last recorded call, per level: sent, exact, bits/element."""
    from megatron_sdp4bit.comm import get_wire_stats

    stats = get_wire_stats()
    collective = "reduce_scatter" if kind == "rs" else "all_gather"
    return {level: {"sent": stats.sent_bytes(collective, level),
                    "exact": stats.exact_bytes(collective, level),
                    "bits_per_element": stats.bits_per_element(collective, level)}
            for level in LEVELS}


def run_cases(cases: Sequence[Case], numel: int, repeats: int, ranks_per_node: int,
              dtype: str = "bf16", device=None) -> List[dict]:
    """Every case on this process group: ``{label, kind, seconds, bytes}`` in case order,
    on tensors of ``device`` (default CPU)."""
    from megatron_sdp4bit.comm import reset_wire_stats

    buffers = _buffers(numel, dtype, device)
    rows = []
    for case in cases:
        call = make_call(case, buffers, ranks_per_node)
        call()  # warm-up (and the topology's first build)
        reset_wire_stats()
        call()
        recorded = _bytes(case.kind)
        rows.append({"label": case.label, "kind": case.kind, "seconds": time_call(call, repeats, device),
                     "bytes": recorded})
    return rows


def read_rows(output: str) -> Optional[List[dict]]:
    """The rows rank 0 printed in a job's ``output`` (None: it printed none)."""
    lines = [line for line in output.splitlines() if line.startswith(MARK)]
    return json.loads(lines[0][len(MARK):]) if lines else None


def main(argv: Optional[List[str]] = None) -> int:
    import torch
    import torch.distributed as dist

    from megatron_sdp4bit.comm import forget_subgroups
    from megatron_sdp4bit.diagnostics.world import (
        BACKENDS, Machine, WorldError, choose_backend, start_world)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", choices=sorted(CASE_SETS), required=True)
    parser.add_argument("--numel", type=int, required=True, help="bucket size in elements")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="the model buffer the weight all-gather writes")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo",
                        help="gloo (default: the CPU ranks of the published tables), nccl "
                             "(one GPU per rank, world 'cpu:gloo,cuda:nccl') or auto (nccl when "
                             "this node's 2 or more ranks each have a GPU, else gloo)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    machine = Machine.here(os.environ)
    try:
        backend = choose_backend(args.backend, machine)
        device = start_world(backend, machine)
    except WorldError as error:
        print(f"benchmarks.collectives: error: {error}", file=sys.stderr)
        return 2
    try:
        rows = run_cases(CASE_SETS[args.cases], args.numel, args.repeats, args.ranks_per_node,
                         args.dtype, device)
        for row in rows:  # what the table's reader must know: auto chose it
            row["backend"] = backend
        if dist.get_rank() == 0:
            print(MARK + json.dumps(rows), flush=True)
    finally:
        forget_subgroups()  # no subgroup may outlive the process group (comm.topology)
        dist.destroy_process_group()
    return 0


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def bytes_table(rows: Sequence[dict], world: int, ranks_per_node: int, numel: int,
                repeats: int, backend: str = "gloo") -> str:
    """``scripts/bench_collectives.py``'s markdown table: time vs the exact collective of
    the same kind (its first row) and the bytes per rank and level."""
    where = "gloo ranks on one CPU host" if backend == "gloo" else "NCCL ranks, one GPU each,"
    lines = [
        f"{world} {where} as {world // ranks_per_node} emulated nodes x "
        f"{ranks_per_node}, bucket of {numel:,} elements, median of {repeats} "
        f"(max over ranks). Bytes are per rank per call; exact = what the exact collective "
        f"sends for the same call.",
        "",
        "| variant | median ms | time vs exact | sent intra KiB | sent inter KiB "
        "| exact intra KiB | exact inter KiB | bits/elt intra | bits/elt inter |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    baseline: Dict[str, float] = {}
    for row in rows:
        seconds, by_level = row["seconds"], row["bytes"]
        baseline.setdefault(row["kind"], seconds)
        lines.append(
            f"| {row['label']} | {seconds * 1e3:.1f} | {seconds / baseline[row['kind']]:.2f}x "
            f"| {_kib(by_level['intra']['sent'])} | {_kib(by_level['inter']['sent'])} "
            f"| {_kib(by_level['intra']['exact'])} | {_kib(by_level['inter']['exact'])} "
            f"| {by_level['intra']['bits_per_element']:.2f} "
            f"| {by_level['inter']['bits_per_element']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
