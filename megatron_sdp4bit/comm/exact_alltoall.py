"""An exact reduce-scatter built from one all-to-all: the bytes a ring reduce-scatter moves.

gloo's ``reduce_scatter_tensor`` runs a ring *all-reduce* and keeps one shard,
so it moves twice the bytes of a ring reduce-scatter (measured on the emulated
slow link, docs/performance.md). This one sends every shard straight to its
owner with ``all_to_all_single`` and sums the P received shards locally, in
fp32, in group-rank order: each rank sends ``(P - 1) * shard`` elements, as
many as a ring reduce-scatter (NCCL's) sends per rank, and nothing is
quantized. Used as the exact baseline of ``scripts/bench_slow_link.py``;
megatron-core's ``reduce_scatter_with_fp32_accumulation`` works the same way
but takes only ``SUM`` and synchronous calls.

Same contract as ``torch.distributed.reduce_scatter_tensor(output, input, op,
group, async_op)`` (``SUM`` or ``AVG``). The result equals the exact
reduction up to the order of the fp32 additions (identical when they are
exact, e.g. integer-valued inputs). Bytes are not recorded here: the callers
in ``comm`` record an exact reduce-scatter's bytes themselves.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.handles import PendingCollective, finish_or_handle


def alltoall_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                            group=None, async_op: bool = False) -> Optional[PendingCollective]:
    """``reduce_scatter_tensor`` as an all-to-all plus a local fp32 sum."""
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"op={op!r} is not supported; use ReduceOp.SUM or ReduceOp.AVG")
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if input.numel() != size * output.numel():
        raise ValueError(f"input has {input.numel()} elements but must have group size ({size}) "
                         f"x output ({output.numel()}) = {size * output.numel()}")
    if input.dtype != output.dtype:
        raise ValueError(f"input ({input.dtype}) and output ({output.dtype}) must share a dtype")
    received = torch.empty_like(input).view(-1)
    work = dist.all_to_all_single(received, input.contiguous().view(-1), group=group, async_op=True)

    def finish() -> None:
        work.wait()
        total = received.view(size, -1).sum(dim=0, dtype=torch.float32)
        if op == dist.ReduceOp.AVG:
            total /= size
        output.view(-1).copy_(total)

    return finish_or_handle(finish, async_op)
