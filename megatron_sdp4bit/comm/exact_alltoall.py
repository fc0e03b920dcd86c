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

Chunked: megatron without overlap makes one bucket of the whole model (about 27 GB
of fp32 gradients for 6.7B parameters), and one temporary the size of the input
would double that. Each chunk sends the same columns of every rank's shard, so
the temporaries hold at most about ``CHUNK_ELEMENTS`` received elements (and as
many to send) whatever the bucket. Chunk widths are multiples of
``COLUMN_QUANTUM`` columns: torch's column-wise sum on CPU then groups its
additions as it does for the whole shard, so a chunked result equals the
unchunked one bit for bit (tested on CPU; on CUDA not checked yet, and either way
within the contract's "up to the order of the fp32 additions").

Only synchronous calls are chunked. An ``async_op`` call (megatron's
``--overlap-grad-reduce``) issues its one all-to-all at the call and returns, as
torch's own collectives do: chunking it would make the caller wait for every chunk
but the last before it could go on with the backward pass. Its temporary is the
bucket's size, which megatron bounds under overlap (``--bucket-size``, 40M elements
by default); the whole-model bucket comes only without overlap, synchronously.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.handles import PendingCollective, finish_or_handle


CHUNK_ELEMENTS = 1 << 22
"""Received elements per chunk (16 MB of fp32), the bound on each temporary."""

COLUMN_QUANTUM = 4096
"""Chunk widths are multiples of this many columns (see the module's docstring)."""


def chunk_columns(shard: int, size: int, chunk_elements: int = CHUNK_ELEMENTS) -> list:
    """The ``(start, stop)`` column ranges of a ``size``-rank call with ``shard`` elements per
    rank: one range when the whole input fits in ``chunk_elements``, else ranges of a
    multiple of ``COLUMN_QUANTUM`` columns (at least one quantum), the last one shorter."""
    if size * shard <= chunk_elements:
        return [(0, shard)]
    width = max(COLUMN_QUANTUM, chunk_elements // size // COLUMN_QUANTUM * COLUMN_QUANTUM)
    return [(start, min(start + width, shard)) for start in range(0, shard, width)]


def alltoall_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                            group=None, async_op: bool = False,
                            chunk_elements: int = CHUNK_ELEMENTS) -> Optional[PendingCollective]:
    """``reduce_scatter_tensor`` as an all-to-all plus a local fp32 sum; a synchronous call in
    chunks of at most about ``chunk_elements`` received elements (``chunk_columns``), an
    ``async_op`` one as one all-to-all issued now (the module's docstring says why)."""
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"op={op!r} is not supported; use ReduceOp.SUM or ReduceOp.AVG")
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if input.numel() != size * output.numel():
        raise ValueError(f"input has {input.numel()} elements but must have group size ({size}) "
                         f"x output ({output.numel()}) = {size * output.numel()}")
    if input.dtype != output.dtype:
        raise ValueError(f"input ({input.dtype}) and output ({output.dtype}) must share a dtype")
    shard = output.numel()
    rows = input.contiguous().view(size, shard)  # row r: the shard rank r owns
    out = output.view(-1)
    chunks = [(0, shard)] if async_op else chunk_columns(shard, size, chunk_elements)
    width = chunks[0][1] - chunks[0][0]
    received = torch.empty(size * width, dtype=input.dtype, device=input.device)
    to_send = None if len(chunks) == 1 else torch.empty_like(received)

    def start(begin: int, end: int):
        count = size * (end - begin)
        if to_send is None:
            send = rows.view(-1)
        else:
            send = to_send[:count].view(size, end - begin)
            send.copy_(rows[:, begin:end])
            send = send.view(-1)
        return dist.all_to_all_single(received[:count], send, group=group, async_op=True)

    def reduce_into_output(begin: int, end: int) -> None:
        total = received[:size * (end - begin)].view(size, -1).sum(dim=0, dtype=torch.float32)
        if op == dist.ReduceOp.AVG:
            total /= size
        out[begin:end].copy_(total)

    for begin, end in chunks[:-1]:
        start(begin, end).wait()
        reduce_into_output(begin, end)
    last = chunks[-1]
    work = start(*last)

    def finish() -> None:
        work.wait()
        reduce_into_output(*last)

    return finish_or_handle(finish, async_op)
