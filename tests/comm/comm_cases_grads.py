"""Reduce-scatter cases, run inside every rank; they return plain numbers the tests assert on.

Every case compares ``quantized_reduce_scatter`` with torch's exact
``reduce_scatter_tensor`` on the same inputs (and, for quantized modes, with
the scale-derived bound of ``comm.error_bounds``).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.error_bounds import reduce_scatter_bound, tolerance
from megatron_sdp4bit.comm import get_wire_stats, quantized_reduce_scatter, reset_wire_stats
from megatron_sdp4bit.config import SDP4BitConfig

MODES = ("off", "tlq-hs", "tlq", "ulq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
SHARD_SIZES = (1, 37, 300, 1024)  # odd sizes exercise the padding
SCHEDULES = ((False, 1), (False, 4), (True, 1), (True, 4))  # (async_op, pipeline chunks)


def make_input(rank: int, seed: int, numel: int, dtype, integers: bool,
               outliers: float = 0.0) -> torch.Tensor:
    """Deterministic per (seed, rank); small integers make exact sums exact in fp32/bf16."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if integers:
        return torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
    x = torch.randn(numel, generator=gen)
    if outliers:
        spikes = torch.rand(numel, generator=gen) < 0.002
        x[spikes] *= outliers
    return x.to(dtype)


def run_reduce_scatter(x: torch.Tensor, config, op, group=None, async_op=False,
                       generator=None) -> torch.Tensor:
    dp = dist.get_world_size(group)
    out = torch.empty(x.numel() // dp, dtype=x.dtype)
    handle = quantized_reduce_scatter(out, x, op=op, group=group, config=config,
                                      async_op=async_op, generator=generator)
    if async_op:
        assert handle is not None and hasattr(handle, "wait"), "async_op must return a handle"
        handle.wait()
    else:
        assert handle is None, "a synchronous call returns None, like torch.distributed"
    return out


def exact_reduce_scatter(x: torch.Tensor, op, group=None) -> torch.Tensor:
    out = torch.empty(x.numel() // dist.get_world_size(group), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.clone(), op=op, group=group)
    return out


def compare_with_bound(x, out, config, op, group, num_nodes) -> dict:
    """max(|out - exact| / tolerance) over this rank's shard, with the error itself."""
    dp = dist.get_world_size(group)
    reference = exact_reduce_scatter(x.float(), op, group)
    gathered = [torch.empty(x.numel()) for _ in range(dp)]
    dist.all_gather(gathered, x.float(), group=group)
    inputs = torch.stack(gathered)
    bound = reduce_scatter_bound(inputs, dist.get_rank(group), config, num_nodes,
                                 op == dist.ReduceOp.AVG)
    scale = float(inputs.abs().amax(1).sum()) if inputs.numel() else 0.0
    tol = tolerance(bound, reference, scale, out.dtype)
    err = (out.double() - reference.double()).abs()
    return {"ratio": float((err / tol).max()), "max_err": float(err.max()),
            "max_bound": float(bound.max())}


def matrix_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """Every mode x dtype x op x schedule, rotating through the shard sizes."""
    num_nodes = max(1, world // rpn)
    combos = itertools.product(MODES, DTYPES.items(), OPS.items(), SCHEDULES)
    for index, (mode, (dname, dtype), (oname, op), (async_op, chunks)) in enumerate(combos):
        shard = SHARD_SIZES[index % len(SHARD_SIZES)]
        config = SDP4BitConfig(grad_mode=mode, ranks_per_node=rpn, pipeline_chunks=chunks)
        x = make_input(rank, index, world * shard, dtype, integers=(mode == "off"))
        out = run_reduce_scatter(x, config, op, async_op=async_op)
        key = f"rs|rpn={rpn}|{mode}|{dname}|{oname}|async={async_op}|chunks={chunks}|s={shard}"
        if mode == "off":
            same = torch.equal(out, exact_reduce_scatter(x, op))
            exact32 = exact_reduce_scatter(x.float(), op)
            results[key] = {"bitwise": same, "matches_fp32": torch.equal(out.float(), exact32)}
        else:
            results[key] = compare_with_bound(x, out, config, op, None, num_nodes)
    # Unequal intra/inter group sizes: the chunks must align to both.
    config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, grad_group_size_intra=256,
                           grad_group_size_inter=64, pipeline_chunks=3)
    x = make_input(rank, 99, world * 700, torch.float32, integers=False)
    out = run_reduce_scatter(x, config, dist.ReduceOp.SUM)
    results[f"rs|rpn={rpn}|tlq-hs-g256-64"] = compare_with_bound(x, out, config,
                                                                  dist.ReduceOp.SUM, None,
                                                                  num_nodes)


def wire_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """Byte counters of one fp32 reduce-scatter per mode (shard a multiple of every group)."""
    for mode in MODES:
        config = SDP4BitConfig(grad_mode=mode, ranks_per_node=rpn)
        x = make_input(rank, 7, world * 1024, torch.float32, integers=False)
        reset_wire_stats()
        run_reduce_scatter(x, config, dist.ReduceOp.SUM)
        results[f"wire|rs|rpn={rpn}|{mode}"] = get_wire_stats().as_dict()


def schedule_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """With nearest rounding, chunking, async, aliasing and interleaving change nothing."""
    config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, rounding="nearest")
    x = make_input(rank, 11, world * 3000, torch.bfloat16, integers=False)
    y = make_input(rank, 12, world * 2000, torch.float32, integers=False)
    avg = dist.ReduceOp.AVG
    base_x = run_reduce_scatter(x, config, avg)
    base_y = run_reduce_scatter(y, config, avg)
    chunked = run_reduce_scatter(x, config.replace(pipeline_chunks=4), avg, async_op=True)
    # Two collectives in flight at once, waited in launch order.
    out_x, out_y = torch.empty_like(base_x), torch.empty_like(base_y)
    cfg4 = config.replace(pipeline_chunks=4)
    hx = quantized_reduce_scatter(out_x, x, op=avg, config=cfg4, async_op=True)
    hy = quantized_reduce_scatter(out_y, y, op=avg, config=cfg4, async_op=True)
    done_early = hx.is_completed()
    hx.wait()
    hy.wait()
    hy.wait()  # a second wait is a no-op
    # Megatron style: the output is a view of the input's own shard.
    buffer = x.clone()
    shard = buffer.numel() // world
    aliased = buffer[rank * shard:(rank + 1) * shard]
    quantized_reduce_scatter(aliased, buffer, op=avg, config=cfg4)
    # A bucket larger than a chunk may hold: many chunks launched one after another,
    # sync or async (one chunk in flight at call time), the output aliasing the input
    # as above. Both take the same steps in the same order, so with stochastic
    # rounding they draw the same random numbers: bit-identical too.
    from megatron_sdp4bit.comm import gradients

    stochastic = config.replace(rounding="stochastic")
    caps = gradients.MAX_CHUNK_ELEMENTS, gradients.MIN_CHUNK_SHARD_ELEMENTS
    gradients.MAX_CHUNK_ELEMENTS, gradients.MIN_CHUNK_SHARD_ELEMENTS = world * 256, 1
    try:
        capped_sync = buffer_capped = x.clone()
        capped_view = buffer_capped[rank * shard:(rank + 1) * shard]
        quantized_reduce_scatter(capped_view, capped_sync, op=avg, config=config)
        capped_async = run_reduce_scatter(x, config, avg, async_op=True)
        rounded = [run_reduce_scatter(x, stochastic, avg, async_op=async_op,
                                      generator=torch.Generator().manual_seed(5 + rank))
                   for async_op in (False, True)]
    finally:
        gradients.MAX_CHUNK_ELEMENTS, gradients.MIN_CHUNK_SHARD_ELEMENTS = caps
    results[f"sched|rpn={rpn}"] = {
        "capped_chunks": torch.equal(capped_view, base_x) and torch.equal(capped_async, base_x),
        "stochastic_async_is_sync": torch.equal(*rounded),
        "chunked_async": torch.equal(chunked, base_x),
        "interleaved": torch.equal(out_x, base_x) and torch.equal(out_y, base_y),
        "aliased": torch.equal(aliased, base_x),
        "completed_before_wait": done_early,
        "completed_after_wait": hx.is_completed(),
    }
