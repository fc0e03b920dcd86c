#!/usr/bin/env python
"""Time and bytes of each quantized collective vs the exact one, on local gloo ranks.

Runs ``--ranks`` CPU processes (default 4 = 2 emulated nodes x 2) and, for one
bucket of ``--numel`` elements, measures the median wall time of each variant
(max over ranks of each repeat) and the bytes each rank sent per level, from
``megatron_sdp4bit.comm.get_wire_stats``. Prints a markdown table; with
``--write-doc docs/performance.md`` it also replaces (or appends) that file's
"## Collectives" section.

On one machine the "network" is loopback memory copies, so times mostly
measure the quantization arithmetic; the byte columns are what carries over
to real links.

    python scripts/bench_collectives.py                    # 4 ranks, 1M elements
    python scripts/bench_collectives.py --numel 262144 --repeats 3
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_sdp4bit.comm import (  # noqa: E402
    get_wire_stats,
    quantized_all_gather_weights,
    quantized_reduce_scatter,
    reset_wire_stats,
)
from megatron_sdp4bit.config import SDP4BitConfig  # noqa: E402

# (label, collective, config fields) in table order; the first of each collective is exact.
VARIANTS = [
    ("exact reduce-scatter (fp32)", "rs", dict(grad_mode="off")),
    ("TLq-HS 8/4 g128 (paper)", "rs", dict(grad_mode="tlq-hs")),
    ("TLq-HS 8/4, 4 pipeline chunks", "rs", dict(grad_mode="tlq-hs", pipeline_chunks=4)),
    ("TLq 8/4 (no Hadamard)", "rs", dict(grad_mode="tlq")),
    ("ULq 4/4 (ZeRO++ qgZ)", "rs", dict(grad_mode="ulq")),
    ("exact all-gather (bf16)", "ag", dict(weight_mode="off")),
    ("qWD 4-bit g2048 (paper)", "ag", dict(weight_mode="diff")),
    ("qW 4-bit g2048 (ZeRO++ qwZ)", "ag", dict(weight_mode="direct")),
]


def _run_once(kind: str, config: SDP4BitConfig, buffers: dict) -> None:
    if kind == "rs":
        quantized_reduce_scatter(buffers["grad_out"], buffers["grads"], config=config)
    else:
        quantized_all_gather_weights(buffers["model"], buffers["main"], config=config)


def _worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    shard = args.numel // world
    gen = torch.Generator().manual_seed(rank)
    model = torch.randn(world * shard, generator=torch.Generator().manual_seed(0))
    buffers = {
        "grads": torch.randn(world * shard, generator=gen),
        "grad_out": torch.empty(shard),
        "model": model.bfloat16(),
        "main": model[rank * shard:(rank + 1) * shard] + 1e-3 * torch.randn(shard, generator=gen),
    }
    rows = []
    for label, kind, fields in VARIANTS:
        config = SDP4BitConfig(ranks_per_node=args.ranks_per_node, **fields)
        _run_once(kind, config, buffers)  # warm-up (and the topology's first build)
        reset_wire_stats()
        _run_once(kind, config, buffers)
        stats = get_wire_stats()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            _run_once(kind, config, buffers)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective ends on its slowest rank
            times.append(float(elapsed))
        rows.append((label, kind, statistics.median(times), stats))
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(_table(rows, args, world))
    dist.destroy_process_group()


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f}"


def _table(rows, args, world: int) -> str:
    lines = [
        f"{world} gloo ranks on one CPU host as {world // args.ranks_per_node} emulated nodes x "
        f"{args.ranks_per_node}, bucket of {args.numel:,} elements, median of {args.repeats} "
        f"(max over ranks). Bytes are per rank per call; exact = what the exact collective "
        f"sends for the same call.",
        "",
        "| variant | median ms | time vs exact | sent intra KiB | sent inter KiB "
        "| exact intra KiB | exact inter KiB | bits/elt intra | bits/elt inter |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    baseline = {}
    for label, kind, seconds, stats in rows:
        collective = "reduce_scatter" if kind == "rs" else "all_gather"
        baseline.setdefault(kind, seconds)
        lines.append(
            f"| {label} | {seconds * 1e3:.1f} | {seconds / baseline[kind]:.2f}x "
            f"| {_kib(stats.sent_bytes(collective, 'intra'))} "
            f"| {_kib(stats.sent_bytes(collective, 'inter'))} "
            f"| {_kib(stats.exact_bytes(collective, 'intra'))} "
            f"| {_kib(stats.exact_bytes(collective, 'inter'))} "
            f"| {stats.bits_per_element(collective, 'intra'):.2f} "
            f"| {stats.bits_per_element(collective, 'inter'):.2f} |"
        )
    return "\n".join(lines) + "\n"


SECTION_HEADING = "## Collectives"
BEGIN, END = "<!-- bench_collectives:begin -->", "<!-- bench_collectives:end -->"


def write_doc_section(path: str, table: str, command: str) -> None:
    """Replace the table between this script's markers, or append a "## Collectives" section.

    Text outside the markers (the section's prose, other people's sections)
    is left as it is.
    """
    block = f"{BEGIN}\nProduced by `{command}`.\n\n{table}{END}"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + f"{SECTION_HEADING}\n\n{block}\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 20, help="bucket size in elements")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--write-doc", metavar="PATH", help="update this markdown file")
    args = parser.parse_args()
    if args.numel % args.ranks:
        parser.error(f"--numel must be a multiple of --ranks ({args.ranks})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = f"/tmp/bench_collectives_{os.getpid()}.md"
    mp.spawn(_worker, args=(args.ranks, port, args, out_path), nprocs=args.ranks)
    table = open(out_path, encoding="utf-8").read()
    os.remove(out_path)
    print(table)
    if args.write_doc:
        command = "python scripts/bench_collectives.py " + " ".join(sys.argv[1:])
        write_doc_section(args.write_doc, table, command.strip())


if __name__ == "__main__":
    main()
