"""The all-to-all exact reduce-scatter (benchmark baseline) against torch's, on real gloo ranks.

``alltoall_cases`` runs inside every rank of the shared worlds of 2 and 4 (``comm_worlds``).
The chunked path (a whole-model bucket must not get a whole-bucket temporary) runs there
with the chunk size lowered to a few chunks: equal to torch's collective on integer
inputs, bit-identical to the unchunked call on random ones, each all-to-all bounded.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm_worlds import battery
from megatron_sdp4bit.comm.exact_alltoall import (
    CHUNK_ELEMENTS, COLUMN_QUANTUM, alltoall_reduce_scatter, chunk_columns)


@battery.case(2, 4)
def alltoall_cases(rank: int, world: int) -> dict:
    """Every multi-rank check of this file, by name: True where it holds."""
    out = {}
    shard = 37
    # Integer-valued fp32: every sum is exact, so any summation order gives the same bits.
    ints = torch.randint(-50, 50, (world * shard,), generator=torch.Generator().manual_seed(rank))
    ints = ints.float()
    for op_name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        ours, ref = torch.empty(shard), torch.empty(shard)
        alltoall_reduce_scatter(ours, ints.clone(), op=op)
        dist.reduce_scatter_tensor(ref, ints.clone(), op=op)
        out[f"int_{op_name}_equal"] = torch.equal(ours, ref)
    # Random fp32 and bf16: equal up to the order of the additions.
    x = torch.randn(world * 300, generator=torch.Generator().manual_seed(10 + rank))
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        ours, ref = torch.empty(300, dtype=dtype), torch.empty(300, dtype=dtype)
        alltoall_reduce_scatter(ours, xs.clone(), op=dist.ReduceOp.SUM)
        # shard `rank` of every rank's input, summed in fp32
        exact = torch.stack([t.to(dtype).float().view(world, 300)[rank]
                             for t in _all_inputs(world)]).sum(dim=0)
        dist.reduce_scatter_tensor(ref, xs.clone(), op=dist.ReduceOp.SUM)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        out[f"{dtype}_close"] = bool(torch.allclose(ours.float(), exact, atol=tol, rtol=tol))
        out[f"{dtype}_close_to_torch"] = bool(torch.allclose(ours.float(), ref.float(),
                                                             atol=tol * 4, rtol=tol * 4))
    # Output a view of the input (megatron passes the bucket's own shard); async handle.
    buf = ints.clone()
    view = buf[rank * shard:(rank + 1) * shard]
    handle = alltoall_reduce_scatter(view, buf, op=dist.ReduceOp.SUM, async_op=True)
    handle.wait()
    ref = torch.empty(shard)
    dist.reduce_scatter_tensor(ref, ints.clone(), op=dist.ReduceOp.SUM)
    out["view_async_equal"] = torch.equal(view, ref)
    # Inside megatron's coalescing manager, synchronously, as param_and_grad_buffer calls it.
    from torch.distributed import _coalescing_manager

    coalesced = torch.empty(shard)
    with _coalescing_manager(dist.group.WORLD, async_ops=False):
        alltoall_reduce_scatter(coalesced, ints.clone(), op=dist.ReduceOp.SUM,
                                group=dist.group.WORLD, async_op=False)
    out["coalesced_equal"] = torch.equal(coalesced, ref)
    out.update(_chunked_cases(rank, world))
    return out


def _chunked_cases(rank: int, world: int) -> dict:
    """Four chunks of COLUMN_QUANTUM columns (the last one short), against torch and the unchunked call."""
    out = {}
    shard, chunk_elements = 3 * COLUMN_QUANTUM + 37, world * COLUMN_QUANTUM
    sizes = []
    real_all_to_all = dist.all_to_all_single

    def recording(output, input, *args, **kwargs):
        sizes.append(output.numel())
        return real_all_to_all(output, input, *args, **kwargs)

    ints = torch.randint(-50, 50, (world * shard,), generator=torch.Generator().manual_seed(rank)).float()
    dist.all_to_all_single = recording
    try:
        for op_name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
            ours, ref = torch.empty(shard), torch.empty(shard)
            alltoall_reduce_scatter(ours, ints.clone(), op=op, chunk_elements=chunk_elements)
            dist.reduce_scatter_tensor(ref, ints.clone(), op=op)
            out[f"chunked_int_{op_name}_equal"] = torch.equal(ours, ref)
        buf = ints.clone()  # megatron's call: the output is this rank's shard of the input, async
        view = buf[rank * shard:(rank + 1) * shard]
        handle = alltoall_reduce_scatter(view, buf, async_op=True, chunk_elements=chunk_elements)
        out["async_issued_at_the_call"] = sizes[-1:] == [world * shard]  # one all-to-all, nothing waited for
        handle.wait()
        out["chunked_view_async_equal"] = torch.equal(view, ref * world)
    finally:
        dist.all_to_all_single = real_all_to_all
    # the 2 synchronous calls: 4 chunks each; the async one: one all-to-all (megatron's bucket)
    out["chunked_calls_bounded"] = sizes == ([chunk_elements] * 3 + [world * 37]) * 2 + [world * shard]
    x = torch.randn(world * shard, generator=torch.Generator().manual_seed(20 + rank))
    for dtype in (torch.float32, torch.bfloat16):
        chunked, whole = torch.empty(shard, dtype=dtype), torch.empty(shard, dtype=dtype)
        alltoall_reduce_scatter(chunked, x.to(dtype), chunk_elements=chunk_elements)
        alltoall_reduce_scatter(whole, x.to(dtype))
        out[f"chunked_{dtype}_bit_identical"] = torch.equal(chunked, whole)
    return out


def _all_inputs(world):
    """Every rank's random input, regenerated locally from the seeds the ranks use."""
    return [torch.randn(world * 300, generator=torch.Generator().manual_seed(10 + r))
            for r in range(world)]


@pytest.mark.parametrize("size", [2, 4])
def test_alltoall_reduce_scatter_matches_torch(size):
    for rank, result in enumerate(battery.results(alltoall_cases, size)):
        failed = [name for name, ok in result.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def test_alltoall_reduce_scatter_rejects_bad_calls():
    from unittest import mock

    with mock.patch.object(dist, "get_world_size", return_value=2):
        with pytest.raises(ValueError, match="ReduceOp.SUM or ReduceOp.AVG"):
            alltoall_reduce_scatter(torch.empty(2), torch.empty(4), op=dist.ReduceOp.MAX,
                                    group=object())
        with pytest.raises(ValueError, match="group size"):
            alltoall_reduce_scatter(torch.empty(3), torch.empty(4), group=object())
        with pytest.raises(ValueError, match="share a dtype"):
            alltoall_reduce_scatter(torch.empty(2, dtype=torch.bfloat16), torch.empty(4),
                                    group=object())


def test_chunks_cover_the_shard_in_bounded_quantum_widths():
    assert chunk_columns(300, 4) == [(0, 300)]  # fits: one chunk, the whole input as today
    shard, size = 6_700_000_000 // 128, 128  # a 6.7B model's one bucket over DP 128
    chunks = chunk_columns(shard, size)
    assert chunks[0][0] == 0 and chunks[-1][1] == shard
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all((stop - start) % COLUMN_QUANTUM == 0 for start, stop in chunks[:-1])
    assert max(stop - start for start, stop in chunks) * size <= CHUNK_ELEMENTS
    assert chunk_columns(10 * COLUMN_QUANTUM, 2 * CHUNK_ELEMENTS)[0] == (0, COLUMN_QUANTUM)  # at least one quantum


@pytest.mark.parametrize("size", [2, 3, 8, 64, 128])
def test_torch_sums_quantum_wide_columns_as_it_sums_the_whole(size):
    """What the bit-identity of chunked calls rests on, on this machine's torch."""
    shard = 5 * COLUMN_QUANTUM + 37
    x = torch.randn(size, shard, generator=torch.Generator().manual_seed(size)) * torch.logspace(-3, 3, shard)
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        whole = rows.sum(dim=0, dtype=torch.float32)
        chunked = torch.cat([rows[:, a:b].contiguous().sum(dim=0, dtype=torch.float32)
                             for a, b in chunk_columns(shard, size, size * 2 * COLUMN_QUANTUM)])
        assert torch.equal(chunked, whole)
