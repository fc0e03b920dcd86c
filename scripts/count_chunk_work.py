#!/usr/bin/env python
"""Host work per chunk of the quantized reduce-scatter, and chunks per step of a model.

Without a GPU and without peers (``megatron_sdp4bit.benchmarks.chunk_work``): a
fake process group of ``--dp`` ranks, the Triton ops in recording mode. Prints per
chunk the Triton launches, collective calls, other device operators, host reads and
the host's CPU time, for fp32 and bf16 gradients; then the chunks one step makes for
``--config`` at ``--dp`` (megatron's default buckets), and with 4M-element chunks
(the cap before issue 26) for comparison. Run ``make setup`` first.

    python scripts/count_chunk_work.py                       # DP 16, 8 ranks a node, gpt_6.7b
    python scripts/count_chunk_work.py --dp 8 --ranks-per-node 4 --json chunk_work.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from megatron_sdp4bit.benchmarks.chunk_work import chunks_per_step, model_buckets
from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS
from megatron_sdp4bit.config import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_MAX_CHUNK_ELEMENTS = 1 << 22


def _one(args) -> dict:
    """In this process: the fake world, one measurement per dtype."""
    import torch

    from megatron_sdp4bit.benchmarks.chunk_work import init_fake_world, measure

    init_fake_world(args.dp, rank=1)
    config = preset("sdp4bit", ranks_per_node=args.ranks_per_node, pipeline_chunks=args.chunks)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        work = measure(args.dp * args.chunk_shard * args.chunks, config, dtype, args.repeats)
        out[name] = work.as_dict()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=16)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--chunks", type=int, default=16, help="chunks of the measured bucket")
    p.add_argument("--chunk-shard", type=int, default=8192,
                   help="elements of each shard per chunk (small: the fake sends cost little)")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_6.7b.yaml"))
    p.add_argument("--json", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args)))
        return 0
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--one"] + sys.argv[1:],
                           capture_output=True, text=True, cwd=ROOT, check=False)
    if child.returncode:
        print(child.stderr[-3000:], file=sys.stderr)
        return child.returncode
    per_dtype = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"per chunk, DP {args.dp} ({args.ranks_per_node} ranks a node), "
          f"{args.chunk_shard} elements a shard:")
    print(f"{'grads':<6} {'launches':>9} {'collectives':>12} {'other ops':>10} "
          f"{'host reads':>11} {'host us (median, min)':>22}")
    for name, w in per_dtype.items():
        print(f"{name:<6} {w['triton_launches']:>9.1f} {w['collective_calls']:>12.1f} "
              f"{w['device_ops']:>10.1f} {w['host_reads']:>11.1f} "
              f"{w['host_us']:>13.0f}, {w['host_us_min']:>6.0f}")
    buckets = model_buckets(args.config, args.dp)
    config = preset("sdp4bit", ranks_per_node=args.ranks_per_node)
    steps = {cap: chunks_per_step(buckets, args.dp, config, cap)
             for cap in (MAX_CHUNK_ELEMENTS, OLD_MAX_CHUNK_ELEMENTS)}
    print(f"{os.path.basename(args.config)} at DP {args.dp}: {len(buckets)} buckets, "
          f"{steps[MAX_CHUNK_ELEMENTS]} chunks a step ({steps[OLD_MAX_CHUNK_ELEMENTS]} with "
          f"chunks of at most {OLD_MAX_CHUNK_ELEMENTS} elements)")
    print("command: python scripts/count_chunk_work.py " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"per_chunk": per_dtype, "buckets": len(buckets),
                       "chunks_per_step": steps[MAX_CHUNK_ELEMENTS],
                       "chunks_per_step_4m": steps[OLD_MAX_CHUNK_ELEMENTS]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
