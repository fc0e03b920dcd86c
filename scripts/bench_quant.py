#!/usr/bin/env python
"""Throughput of every quantization op next to ``torch.clone`` of the same input.

For each size, one fp32 tensor ``x`` of that many bytes is made on the device and
every op below runs on it (or on its quantized form) in the same process, so the
rows of one size compare like with like. Each figure is the median of
``--repeats`` timed runs after one warm-up run; the ops take turns within each
repeat.

Per op, the table (and ``--json``) gives:

    read, written   bytes of the tensors the op reads and writes per call, taken
                    from its real inputs and outputs: fp32/bf16 tensors at their
                    element size, packed codes at their byte count (4-bit: half a
                    byte per element, padded to whole groups), one fp32 scale per
                    group; an in-place op (dequantize_add_) reads and writes its
                    base. The 8-byte seed of stochastic rounding is not counted.
    GB/s moved      (read + written) / median time: the memory bandwidth the op
                    achieves if each byte moves once (what a fused kernel does).
    x clone bw      that as a fraction of clone's bandwidth in the same run; clone
                    of the fp32 ``x`` moves 2 x its bytes per call (read + write).
                    The target on a GPU (H100/H200, Triton kernels) is
                    >= ``--target`` (0.85): the op runs at the memory roofline.
    target          PASS / FAIL against that target (CUDA only; '-' on CPU, where
                    the torch reference runs and the target does not apply).
    input GB/s      numel(x) * 4 bytes / median time, the same numerator for every
                    row of a size (this script's earlier normalisation, which
                    megatron_sdp4bit/estimate prices collectives with);
    x clone time    clone time / op time (1.0 = as fast as copying x once).

The ops go through the dispatching API ``megatron_sdp4bit.quant``: the torch
reference on CPU, the Triton kernels on CUDA (when Triton imports; the
``backend`` line of the output says which ran).

Usage:
    python scripts/bench_quant.py                      # CPU, quick sizes (8, 64 MiB)
    python scripts/bench_quant.py --sizes 8,64,512     # CPU, sizes in MiB
    python scripts/bench_quant.py --device cuda        # GPU, 2048 MiB by default
    python scripts/bench_quant.py --device cuda --json bench.json   # + the figures as JSON
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_sdp4bit import quant

from megatron_sdp4bit.quant.types import QuantizedTensor

WEIGHT_GROUP = 2048
GRAD_GROUP = 128
HADAMARD_BLOCK = 32
RANKS_PER_NODE = 4  # chunks summed by the two dequantize_sum* ops (one per sender)
MANY_CHUNKS = 8  # the 8-chunk rows: 8 ranks per node (or nodes)
ROWS = 8  # the rows op: the reduce-scatter's input as P = 8 shards, taken in a send order
CLONE = "torch.clone (reference line)"
TARGET = 0.85  # fraction of clone bandwidth every op should reach on an H100/H200


@dataclasses.dataclass
class Op:
    """One benchmarked call: ``fn()`` runs it; ``reads`` are the tensors it reads
    (what it writes is its result)."""

    name: str
    key: str
    fn: Callable[[], object]
    reads: Tuple[object, ...]


def nbytes(*objs: object) -> int:
    """Bytes of tensors and QuantizedTensors (codes + scales), as stored."""
    total = 0
    for obj in objs:
        if isinstance(obj, QuantizedTensor):
            total += nbytes(obj.codes, obj.scales)
        elif isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        else:
            raise TypeError(f"cannot count the bytes of a {type(obj).__name__}")
    return total


def traffic(op: Op, result: object) -> Tuple[int, int]:
    """(bytes read, bytes written) by one call of ``op`` that returned ``result``."""
    return nbytes(*op.reads), nbytes(result)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_ops(x: torch.Tensor, seed: int) -> List[Op]:
    """Every benchmarked op on fp32 ``x``, inputs prepared; the clone first."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    model_bf16 = (x + 1e-3).to(torch.bfloat16)  # plays the model weights for qWD
    base_bf16 = model_bf16.clone()  # dequantize_add_ accumulates into this (drifts; fine)
    q4 = quant.quantize(x, bits=4, group_size=WEIGHT_GROUP, generator=gen)
    q8_grad = quant.hadamard_quantize(x, bits=8, group_size=GRAD_GROUP,
                                      hadamard_block=HADAMARD_BLOCK, generator=gen)
    q4_grad = quant.quantize(x, bits=4, group_size=GRAD_GROUP, generator=gen)
    x_bf16 = x.to(torch.bfloat16)
    rows, order = x.view(ROWS, -1), torch.arange(ROWS, device=x.device).roll(1)
    width = rows.shape[1]
    k, many = RANKS_PER_NODE, MANY_CHUNKS
    return [
        Op(CLONE, "clone", lambda: x.clone(), (x,)),
        Op("quantize 4-bit stochastic G=2048 (packed)", "quantize_4bit_stochastic",
           lambda: quant.quantize(x, 4, WEIGHT_GROUP, "stochastic", gen), (x,)),
        Op("quantize 4-bit nearest G=2048", "quantize_4bit_nearest",
           lambda: quant.quantize(x, 4, WEIGHT_GROUP, "nearest"), (x,)),
        Op("dequantize 4-bit G=2048 -> fp32", "dequantize_4bit_fp32",
           lambda: quant.dequantize(q4), (q4,)),
        Op("quantize_weight_diff 4-bit (fp32 - bf16)", "quantize_weight_diff_4bit",
           lambda: quant.quantize_weight_diff(x, model_bf16, 4, WEIGHT_GROUP, "stochastic", gen),
           (x, model_bf16)),
        Op("dequantize_add_ 4-bit into bf16", "dequantize_add_4bit_bf16",
           lambda: quant.dequantize_add_(base_bf16, q4), (q4, base_bf16)),
        Op("hadamard_quantize 8-bit G=128 H=32", "hadamard_quantize_8bit",
           lambda: quant.hadamard_quantize(x, 8, GRAD_GROUP, HADAMARD_BLOCK, "stochastic", gen,
                                           scale=1.0 / k), (x,)),
        Op(f"dequantize_sum_requantize 8->4-bit, {k} chunks", "dequantize_sum_requantize_8to4",
           lambda: quant.dequantize_sum_requantize(q8_grad, k, 4, GRAD_GROUP, "stochastic", gen),
           (q8_grad,)),
        Op(f"dequantize_sum 4-bit, {k} chunks + inverse H=32", "dequantize_sum_4bit_hadamard",
           lambda: quant.dequantize_sum(q4_grad, k, HADAMARD_BLOCK), (q4_grad,)),
        # bf16 inputs, 8 chunks, and the reduce-scatter's staging read in place.
        Op("quantize 4-bit stochastic G=2048, bf16 input", "quantize_4bit_stochastic_bf16",
           lambda: quant.quantize(x_bf16, 4, WEIGHT_GROUP, "stochastic", gen), (x_bf16,)),
        Op("hadamard_quantize 8-bit G=128 H=32, bf16 input", "hadamard_quantize_8bit_bf16",
           lambda: quant.hadamard_quantize(x_bf16, 8, GRAD_GROUP, HADAMARD_BLOCK, "stochastic",
                                           gen, scale=1.0 / k), (x_bf16,)),
        Op(f"hadamard_quantize_rows 8-bit G=128 H=32, {ROWS} rows in send order",
           "hadamard_quantize_rows_8bit",
           lambda: quant.hadamard_quantize_rows(rows, order, 0, width, width, 8, GRAD_GROUP,
                                                HADAMARD_BLOCK, "stochastic", gen,
                                                scale=1.0 / ROWS), (rows, order)),
        Op(f"dequantize_sum_requantize 8->4-bit, {many} chunks",
           "dequantize_sum_requantize_8to4_8chunks",
           lambda: quant.dequantize_sum_requantize(q8_grad, many, 4, GRAD_GROUP, "stochastic",
                                                   gen), (q8_grad,)),
        Op(f"dequantize_sum 4-bit, {many} chunks + inverse H=32",
           "dequantize_sum_4bit_hadamard_8chunks",
           lambda: quant.dequantize_sum(q4_grad, many, HADAMARD_BLOCK), (q4_grad,)),
    ]


def bench_size(size_mb: float, device: torch.device, repeats: int, seed: int,
               target: float = TARGET) -> dict:
    """Median time and traffic of every op on an fp32 tensor of ``size_mb`` MiB.

    The ops take turns within each repeat, so a burst of load from other jobs on
    a shared machine hits all of them alike instead of one op's whole series.
    """
    # numel a multiple of every group size times the chunk counts, as the collectives pad.
    quantum = WEIGHT_GROUP * max(RANKS_PER_NODE, MANY_CHUNKS, ROWS)
    numel = max(quantum, int(size_mb * 2**20 / 4) // quantum * quantum)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(numel, generator=gen, device=device, dtype=torch.float32)
    ops = make_ops(x, seed)
    moved: Dict[str, Tuple[int, int]] = {}
    for op in ops:  # warm-up (allocator, kernel compilation), and the bytes of the result
        moved[op.key] = traffic(op, op.fn())
    times: Dict[str, List[float]] = {op.key: [] for op in ops}
    for _ in range(repeats):
        for op in ops:
            _sync(device)
            start = time.perf_counter()
            op.fn()
            _sync(device)
            times[op.key].append(time.perf_counter() - start)
    return summarize(size_mb, numel, ops, {k: statistics.median(t) for k, t in times.items()},
                     moved, target)


def summarize(size_mb: float, numel: int, ops: Sequence[Op], seconds: Dict[str, float],
              moved: Dict[str, Tuple[int, int]], target: float = TARGET) -> dict:
    """The figures of one size: clone's, and every other op's against it."""
    clone_read, clone_written = moved["clone"]
    clone_bytes = clone_read + clone_written
    clone_bw = clone_bytes / seconds["clone"]
    rows = []
    for op in ops:
        if op.key == "clone":
            continue
        read, written = moved[op.key]
        bw = (read + written) / seconds[op.key]
        rows.append(dict(
            name=op.name, key=op.key, seconds=seconds[op.key],
            bytes_read=read, bytes_written=written, bytes_per_s=bw,
            fraction_of_clone=bw / clone_bw, meets_target=bw / clone_bw >= target,
            input_bytes_per_s=numel * 4 / seconds[op.key],
            clone_time_ratio=seconds["clone"] / seconds[op.key],
        ))
    return dict(size_mib=size_mb, numel=numel,
                clone=dict(name=CLONE, seconds=seconds["clone"], bytes_read=clone_read,
                           bytes_written=clone_written, bytes_per_s=clone_bw),
                ops=rows)


def format_table(result: dict, judge: bool) -> str:
    """Markdown table of one size; ``judge``: print PASS/FAIL against the target."""
    mib = 2.0**20
    clone = result["clone"]
    lines = [
        f"{result['size_mib']:g} MiB fp32 input ({result['numel']:,} elements):",
        "| op | read MiB | written MiB | ms | GB/s moved | x clone bw | target | "
        "input GB/s | x clone time |",
        "|---|---:|---:|---:|---:|---:|:---:|---:|---:|",
        f"| {clone['name']} | {clone['bytes_read'] / mib:.2f} | {clone['bytes_written'] / mib:.2f} | "
        f"{clone['seconds'] * 1e3:.3f} | {clone['bytes_per_s'] / 1e9:.2f} | 1.00 | - | "
        f"{result['numel'] * 4 / clone['seconds'] / 1e9:.2f} | 1.00 |",
    ]
    for row in result["ops"]:
        verdict = ("PASS" if row["meets_target"] else "FAIL") if judge else "-"
        lines.append(
            f"| {row['name']} | {row['bytes_read'] / mib:.2f} | {row['bytes_written'] / mib:.2f} | "
            f"{row['seconds'] * 1e3:.3f} | {row['bytes_per_s'] / 1e9:.2f} | "
            f"{row['fraction_of_clone']:.2f} | {verdict} | {row['input_bytes_per_s'] / 1e9:.2f} | "
            f"{row['clone_time_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated sizes of the fp32 input in MiB "
                             "(default: 8,64 on CPU, 2048 on CUDA)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per op (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--target", type=float, default=TARGET,
                        help="fraction of clone bandwidth every op should reach (CUDA)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write every figure (bytes, seconds, fractions) as JSON")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA device")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    default_sizes = "2048" if device.type == "cuda" else "8,64"
    try:
        sizes = [float(s) for s in (args.sizes or default_sizes).split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise SystemExit("--sizes needs positive sizes in MiB, e.g. --sizes 8,64,512")

    probe = torch.empty(1, device=device)
    backend = quant.backend_for(probe).__name__
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:  # a shared machine's load explains a lot of the spread: print it
        where = f"cpu, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    judge = device.type == "cuda"
    print(f"device: {where}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"backend: {backend}; median of {args.repeats}"
          + (f"; target >= {args.target:.2f} x clone bandwidth" if judge else ""))
    results = []
    for size in sizes:
        result = bench_size(size, device, args.repeats, args.seed, args.target)
        results.append(result)
        print(format_table(result, judge))
    if judge:
        failed = sorted({row["key"] for r in results for row in r["ops"] if not row["meets_target"]})
        print(f"target: {len(failed)} op(s) below {args.target:.2f} x clone bandwidth"
              + (f": {', '.join(failed)}" if failed else ""))
    if args.json:
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        report = dict(device=where, device_type=device.type, backend=backend,
                      torch=torch.__version__, triton=triton_version, repeats=args.repeats,
                      target_fraction=args.target, target_applies=judge, results=results)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
