#!/usr/bin/env python
"""Throughput of every quantization op next to ``torch.clone`` of the same input.

For each size, one fp32 tensor ``x`` of that many bytes is made on the device and
every op below runs on it (or on its quantized form) in the same process, so the
rows of one size compare like with like. Each figure is the median of
``--repeats`` timed runs after one warm-up run.

    GB/s    = numel(x) * 4 bytes / median time: bytes of the fp32 tensor being
              (de)quantized, the same for every row of a size, so GB/s ratios
              are ratios of times.
    x clone = op GB/s / clone GB/s (1.0 = as fast as copying x once).

The ops go through the dispatching API ``megatron_sdp4bit.quant``: the torch
reference on CPU, the Triton kernels on CUDA (when Triton imports; the
``backend`` line of the output says which ran).

Usage:
    python scripts/bench_quant.py                      # CPU, quick sizes (8, 64 MiB)
    python scripts/bench_quant.py --sizes 8,64,512     # CPU, sizes in MiB
    python scripts/bench_quant.py --device cuda        # GPU, 2048 MiB by default
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

try:
    from megatron_sdp4bit import quant
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_sdp4bit import quant

WEIGHT_GROUP = 2048
GRAD_GROUP = 128
HADAMARD_BLOCK = 32
RANKS_PER_NODE = 4  # chunks summed by the two dequantize_sum* ops (one per sender)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_ops(x: torch.Tensor, seed: int) -> List[Tuple[str, Callable[[], object]]]:
    """(row name, zero-argument callable) for every benchmarked op, inputs prepared."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    model_bf16 = (x + 1e-3).to(torch.bfloat16)  # plays the model weights for qWD
    base_bf16 = model_bf16.clone()  # dequantize_add_ accumulates into this (drifts; fine)
    q4 = quant.quantize(x, bits=4, group_size=WEIGHT_GROUP, generator=gen)
    q8_grad = quant.hadamard_quantize(x, bits=8, group_size=GRAD_GROUP,
                                      hadamard_block=HADAMARD_BLOCK, generator=gen)
    q4_grad = quant.quantize(x, bits=4, group_size=GRAD_GROUP, generator=gen)
    return [
        ("torch.clone (reference line)", lambda: x.clone()),
        ("quantize 4-bit stochastic G=2048 (packed)",
         lambda: quant.quantize(x, 4, WEIGHT_GROUP, "stochastic", gen)),
        ("quantize 4-bit nearest G=2048", lambda: quant.quantize(x, 4, WEIGHT_GROUP, "nearest")),
        ("dequantize 4-bit G=2048 -> fp32", lambda: quant.dequantize(q4)),
        ("quantize_weight_diff 4-bit (fp32 - bf16)",
         lambda: quant.quantize_weight_diff(x, model_bf16, 4, WEIGHT_GROUP, "stochastic", gen)),
        ("dequantize_add_ 4-bit into bf16", lambda: quant.dequantize_add_(base_bf16, q4)),
        ("hadamard_quantize 8-bit G=128 H=32",
         lambda: quant.hadamard_quantize(x, 8, GRAD_GROUP, HADAMARD_BLOCK, "stochastic", gen,
                                         scale=1.0 / RANKS_PER_NODE)),
        (f"dequantize_sum_requantize 8->4-bit, {RANKS_PER_NODE} chunks",
         lambda: quant.dequantize_sum_requantize(q8_grad, RANKS_PER_NODE, 4, GRAD_GROUP,
                                                 "stochastic", gen)),
        (f"dequantize_sum 4-bit, {RANKS_PER_NODE} chunks + inverse H=32",
         lambda: quant.dequantize_sum(q4_grad, RANKS_PER_NODE, HADAMARD_BLOCK)),
    ]


def bench_size(size_mb: float, device: torch.device, repeats: int,
               seed: int) -> Tuple[Dict[str, float], int]:
    """(median seconds of every op, numel) on an fp32 tensor of ``size_mb`` MiB.

    The ops take turns within each repeat, so a burst of load from other jobs on
    a shared machine hits all of them alike instead of one op's whole series.
    """
    # numel a multiple of every group size times the chunk count, as the collectives pad.
    quantum = WEIGHT_GROUP * RANKS_PER_NODE
    numel = max(quantum, int(size_mb * 2**20 / 4) // quantum * quantum)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(numel, generator=gen, device=device, dtype=torch.float32)
    ops = make_ops(x, seed)
    for _, fn in ops:  # warm-up: first-call costs (allocator, kernel compilation)
        fn()
    times: Dict[str, List[float]] = {name: [] for name, _ in ops}
    for _ in range(repeats):
        for name, fn in ops:
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, numel


def format_table(results: Dict[float, Tuple[Dict[str, float], int]]) -> str:
    """Markdown table: one row per op, GB/s and ratio to clone for every size."""
    sizes = list(results)
    header = "| op | " + " | ".join(f"{s:g} MiB GB/s | x clone" for s in sizes) + " |"
    rule = "|---|" + "---:|---:|" * len(sizes)
    names = list(next(iter(results.values()))[0])
    lines = [header, rule]
    for name in names:
        cells = []
        for size in sizes:
            times, numel = results[size]
            gbps = numel * 4 / times[name] / 1e9
            clone_gbps = numel * 4 / times["torch.clone (reference line)"] / 1e9
            cells.append(f"{gbps:.2f} | {gbps / clone_gbps:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated sizes of the fp32 input in MiB "
                             "(default: 8,64 on CPU, 2048 on CUDA)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per op (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()

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
    print(f"device: {where}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"backend: {backend}; median of {args.repeats}")
    results = {size: bench_size(size, device, args.repeats, args.seed) for size in sizes}
    print(format_table(results))


if __name__ == "__main__":
    main()
