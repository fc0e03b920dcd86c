"""The comm tests' worlds, and the helpers their cases share (not a test module).

``battery`` holds the multi-rank cases of every ``test_comm_*.py`` module: each world
size of ``WORLDS`` is started once per session and runs every case registered for it
(``harness.battery``); a test module asserts on its own cases. The statistical cases
make many calls and run in ``STATISTICS_WORLDS`` only.

The helpers compare a collective with torch's exact one on the same inputs:
``make_input``, ``run_reduce_scatter``, ``exact_reduce_scatter``,
``compare_with_bound`` (the scale-derived bound of ``comm.error_bounds``), and
``error_text`` for the cases that check refusals.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness.battery import Battery
from megatron_sdp4bit.comm import quantized_reduce_scatter
from megatron_sdp4bit.comm.error_bounds import reduce_scatter_bound, tolerance

WORLDS = (2, 4, 8)
STATISTICS_WORLDS = (2, 4)
battery = Battery()


def ranks_per_node_choices(world: int) -> list[int]:
    """1, 2 and 4 ranks per node, where they divide the world."""
    return [rpn for rpn in (1, 2, 4) if rpn <= world and world % rpn == 0]


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


def error_text(fn) -> str:
    """'' if ``fn()`` succeeds, else 'ExceptionType: message'."""
    try:
        fn()
    except Exception as exc:  # the tests assert on type and message
        return f"{type(exc).__name__}: {exc}"
    return ""
