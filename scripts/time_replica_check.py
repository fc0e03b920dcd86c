"""Time one run-time replica check (``consistency.check_replicas``) on 4 gloo ranks.

    python scripts/time_replica_check.py

For a bucket of N bf16 elements (5.29 M: the ``make train`` model; 50 M): the
median of 10 checks per rank, one CPU thread per rank; the ranks are a torchrun
job of this script. docs/performance.md. Run ``make setup`` first.
"""
import os
import subprocess
import sys
import time

from megatron_sdp4bit.jobs import job_env, torchrun_command

RANKS = 4
SIZES = (5_290_000, 50_000_000)
CHECKS = 10


def median_check_seconds(numel: int) -> float:
    """This rank's median seconds of one check of a bucket of ``numel`` bf16 elements."""
    import torch

    from megatron_sdp4bit.megatron.consistency import check_replicas

    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    group = torch.distributed.group.WORLD
    check_replicas([("b", x)], group, 0)
    times = []
    for _ in range(CHECKS):
        torch.distributed.barrier()
        start = time.perf_counter()
        check_replicas([("b", x)], group, 0)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def rank_main() -> None:
    """One rank (under torchrun): every size; rank 0 prints each rank's median."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for numel in SIZES:
            medians = [None] * dist.get_world_size()
            dist.all_gather_object(medians, median_check_seconds(numel))
            if dist.get_rank() == 0:
                print(numel, "median ms per check", [round(t * 1e3, 1) for t in medians],
                      flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # a rank of the job below
        rank_main()
    else:
        sys.exit(subprocess.call(torchrun_command(RANKS, [os.path.abspath(__file__)]),
                                 env=job_env()))
