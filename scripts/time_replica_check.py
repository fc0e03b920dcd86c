"""Time one run-time replica check (``consistency.check_replicas``) on 4 gloo ranks.

    python scripts/time_replica_check.py

For a bucket of N bf16 elements (5.29 M: the ``make train`` model; 50 M): the
median of 10 checks per rank, one CPU thread per rank. docs/performance.md.
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")]

import torch  # noqa: E402

from megatron_harness import spawn_ranks  # noqa: E402

def fn(rank, ws, n):
    from megatron_sdp4bit.megatron.consistency import check_replicas
    torch.set_num_threads(1)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    group = torch.distributed.group.WORLD
    check_replicas([("b", x)], group, 0)
    ts = []
    for _ in range(10):
        torch.distributed.barrier()
        t = time.perf_counter(); check_replicas([("b", x)], group, 0); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]

if __name__ == "__main__":
    for n in (5_290_000, 50_000_000):
        print(n, "median ms per check", [round(t * 1e3, 1) for t in spawn_ranks(fn, 4, n, timeout_s=600)])
