"""Topology, non-contiguous DP groups, and bad input, run inside every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from comm_cases_grads import (
    compare_with_bound,
    exact_reduce_scatter,
    make_input,
    run_reduce_scatter,
)
from megatron_sdp4bit.comm import (
    build_topologies,
    get_topology,
    quantized_all_gather_weights,
    quantized_reduce_scatter,
)
from megatron_sdp4bit.config import SDP4BitConfig


def error_text(fn) -> str:
    """'' if ``fn()`` succeeds, else 'ExceptionType: message'."""
    try:
        fn()
    except Exception as exc:  # the tests assert on type and message
        return f"{type(exc).__name__}: {exc}"
    return ""


def describe(rank: int, world: int, rpn: int, results: dict) -> None:
    topo = get_topology(None, ranks_per_node=rpn)
    results[f"topo|rpn={rpn}"] = {
        "dp_size": topo.dp_size, "num_nodes": topo.num_nodes,
        "ranks_per_node": topo.ranks_per_node, "node_index": topo.node_index,
        "local_rank": topo.local_rank, "two_level": topo.is_two_level,
        "intra": dist.get_process_group_ranks(topo.intra_group) if topo.intra_group else None,
        "inter": dist.get_process_group_ranks(topo.inter_group) if topo.inter_group else None,
        "fallback": topo.fallback_reason,
        "cached": get_topology(None, ranks_per_node=rpn) is topo,
    }


def bad_topology_cases(rank: int, world: int, results: dict) -> None:
    """Uneven nodes: flat fallback that still reduces correctly, or ValueError when strict."""
    rpn = world - 1  # e.g. 4 ranks on nodes of 3: sizes 3 and 1
    topo = get_topology(None, ranks_per_node=rpn)
    config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, pipeline_chunks=2)
    x = make_input(rank, 71, world * 500, torch.float32, integers=False)
    out = run_reduce_scatter(x, config, dist.ReduceOp.SUM)
    results["bad|fallback"] = {"reason": topo.fallback_reason, "two_level": topo.is_two_level,
                               **compare_with_bound(x, out, config, dist.ReduceOp.SUM,
                                                    None, num_nodes=world)}
    results["bad|strict"] = error_text(lambda: get_topology(None, ranks_per_node=rpn,
                                                            strict=True))
    # Ranks that disagree on ranks_per_node all get the same error, not a hang.
    # (Values no earlier case used: the check runs when a topology is first built.)
    odd_one_out = world + 1 if rank == 0 else world + 2
    results["bad|disagree"] = error_text(
        lambda: get_topology(None, ranks_per_node=odd_one_out))
    results["bad|disagree_build"] = error_text(
        lambda: build_topologies([list(range(world))], ranks_per_node=odd_one_out))


def strided_dp_cases(rank: int, world: int, results: dict) -> None:
    """DP groups interleaved like tensor parallelism of 2: [0, 2, ...] and [1, 3, ...]."""
    lists = [list(range(start, world, 2)) for start in (0, 1)]
    groups = [dist.new_group(ranks) for ranks in lists]  # every rank creates both
    mine = groups[rank % 2]
    dp = len(lists[0])
    for rpn in (2, 4):
        per_node = rpn // 2  # DP members of one list on a node
        num_nodes = dp // per_node if per_node else dp
        two_level = num_nodes > 1 and per_node > 1
        config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, pipeline_chunks=2)
        if two_level:  # subgroups of a non-world group need the collective build first
            results[f"strided|rpn={rpn}|unbuilt"] = error_text(
                lambda: get_topology(mine, ranks_per_node=rpn))
        build_topologies(lists, ranks_per_node=rpn)
        topo = get_topology(mine, ranks_per_node=rpn)
        x = make_input(rank // 2, 81, dp * 384, torch.float32, integers=False)
        out = run_reduce_scatter(x, config, dist.ReduceOp.SUM, group=mine)
        ints = make_input(rank, 82, dp * 50, torch.float32, integers=True)
        passthrough = run_reduce_scatter(ints, config.replace(grad_mode="off"),
                                         dist.ReduceOp.SUM, group=mine)
        results[f"strided|rpn={rpn}"] = {
            "num_nodes": topo.num_nodes, "ranks_per_node": topo.ranks_per_node,
            "two_level": topo.is_two_level, "expected_two_level": two_level,
            "passthrough_exact": torch.equal(passthrough,
                                             exact_reduce_scatter(ints, dist.ReduceOp.SUM, mine)),
            **compare_with_bound(x, out, config, dist.ReduceOp.SUM, mine, num_nodes),
        }


def bad_input_cases(rank: int, world: int, results: dict) -> None:
    """Every misuse raises ValueError with a message that says what to change."""
    f32 = torch.zeros(world * 4)
    checks = {
        "rs_numel": lambda: quantized_reduce_scatter(torch.zeros(3), f32),
        "rs_op": lambda: quantized_reduce_scatter(torch.zeros(4), f32, op=dist.ReduceOp.MAX),
        "rs_dtype": lambda: quantized_reduce_scatter(torch.zeros(4, dtype=torch.int32),
                                                     torch.zeros(world * 4, dtype=torch.int32)),
        "rs_mixed": lambda: quantized_reduce_scatter(torch.zeros(4, dtype=torch.bfloat16), f32),
        "rs_strided": lambda: quantized_reduce_scatter(torch.zeros(4),
                                                       torch.zeros(world * 8)[::2]),
        "ag_numel": lambda: quantized_all_gather_weights(torch.zeros(world * 4), torch.zeros(5)),
        "ag_dtype": lambda: quantized_all_gather_weights(torch.zeros(world * 4, dtype=torch.int64),
                                                         torch.zeros(4)),
    }
    for name, fn in checks.items():
        results[f"badinput|{name}"] = error_text(fn)
