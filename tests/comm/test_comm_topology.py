"""Topology on real gloo ranks: subgroups, strided DP groups, bad topology, bad input.

Each ``@battery.case`` below runs inside every rank of the shared worlds
(``comm_worlds``) and returns plain data; the tests after it assert on them.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm_worlds import (
    WORLDS,
    battery,
    compare_with_bound,
    error_text,
    exact_reduce_scatter,
    make_input,
    ranks_per_node_choices,
    run_reduce_scatter,
)
from harness import spawn_ranks
from megatron_sdp4bit.comm import (
    build_topologies,
    get_topology,
    quantized_all_gather_weights,
    quantized_reduce_scatter,
)
from megatron_sdp4bit.config import SDP4BitConfig

pytestmark = pytest.mark.slow  # real gloo processes

TWO_GROUP_WORLDS = tuple(w for w in WORLDS if w >= 4)  # two DP groups of 2+, unequal nodes


# --- the subgroups of the world group ------------------------------------------------------

@battery.case(*WORLDS)
def topologies(rank: int, world: int) -> dict:
    """The topology of the world group for every ranks-per-node choice."""
    out = {}
    for rpn in ranks_per_node_choices(world):
        topo = get_topology(None, ranks_per_node=rpn)
        out[rpn] = {
            "dp_size": topo.dp_size, "num_nodes": topo.num_nodes,
            "ranks_per_node": topo.ranks_per_node, "node_index": topo.node_index,
            "local_rank": topo.local_rank, "two_level": topo.is_two_level,
            "intra": dist.get_process_group_ranks(topo.intra_group) if topo.intra_group else None,
            "inter": dist.get_process_group_ranks(topo.inter_group) if topo.inter_group else None,
            "fallback": topo.fallback_reason,
            "cached": get_topology(None, ranks_per_node=rpn) is topo,
        }
    return out


def _expected(world: int, rpn: int, rank: int) -> dict:
    nodes, per_node = world // rpn, rpn
    if nodes == 1:
        return dict(num_nodes=1, ranks_per_node=world, node_index=0, local_rank=rank,
                    two_level=False, intra=list(range(world)), inter=None)
    if per_node == 1:
        return dict(num_nodes=world, ranks_per_node=1, node_index=rank, local_rank=0,
                    two_level=False, intra=None, inter=list(range(world)))
    node, local = divmod(rank, per_node)
    return dict(num_nodes=nodes, ranks_per_node=per_node, node_index=node, local_rank=local,
                two_level=True, intra=list(range(node * per_node, (node + 1) * per_node)),
                inter=list(range(local, world, per_node)))


def test_topology_shape_and_subgroups(world):
    for rank, per_rpn in enumerate(battery.results(topologies, world)):
        assert set(per_rpn) == set(ranks_per_node_choices(world))
        for rpn, got in per_rpn.items():
            want = _expected(world, rpn, rank)
            assert {k: got[k] for k in want} == want, f"rank {rank} rpn={rpn}: {got}"
            assert got["dp_size"] == world and got["fallback"] is None and got["cached"]


# --- DP groups that are not the world ------------------------------------------------------

@battery.case(*TWO_GROUP_WORLDS)
def strided_dp_groups(rank: int, world: int) -> dict:
    """DP groups interleaved like tensor parallelism of 2: [0, 2, ...] and [1, 3, ...]."""
    lists = [list(range(start, world, 2)) for start in (0, 1)]
    groups = [dist.new_group(ranks) for ranks in lists]  # every rank creates both
    mine = groups[rank % 2]
    dp = len(lists[0])
    out = {}
    for rpn in (2, 4):
        per_node = rpn // 2  # DP members of one list on a node
        num_nodes = dp // per_node if per_node else dp
        two_level = num_nodes > 1 and per_node > 1
        config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, pipeline_chunks=2)
        if two_level:  # subgroups of a non-world group need the collective build first
            out[(rpn, "unbuilt")] = error_text(lambda: get_topology(mine, ranks_per_node=rpn))
        build_topologies(lists, ranks_per_node=rpn)
        topo = get_topology(mine, ranks_per_node=rpn)
        x = make_input(rank // 2, 81, dp * 384, torch.float32, integers=False)
        result = run_reduce_scatter(x, config, dist.ReduceOp.SUM, group=mine)
        ints = make_input(rank, 82, dp * 50, torch.float32, integers=True)
        passthrough = run_reduce_scatter(ints, config.replace(grad_mode="off"),
                                         dist.ReduceOp.SUM, group=mine)
        out[(rpn, "built")] = {
            "num_nodes": topo.num_nodes, "ranks_per_node": topo.ranks_per_node,
            "two_level": topo.is_two_level, "expected_two_level": two_level,
            "passthrough_exact": torch.equal(passthrough,
                                             exact_reduce_scatter(ints, dist.ReduceOp.SUM, mine)),
            **compare_with_bound(x, result, config, dist.ReduceOp.SUM, mine, num_nodes),
        }
    return out


def test_strided_dp_groups(world):
    """DP groups [0,2,..] / [1,3,..]: built from their own rank lists, exact and bounded."""
    if world < 4:
        pytest.skip("2 ranks cannot form two strided DP groups of 2+ members; runs at 4 and 8 ranks")
    results = battery.results(strided_dp_groups, world)
    for rank, per_case in enumerate(results):
        for (rpn, kind), value in per_case.items():
            if kind == "unbuilt":  # two-level subgroups of a non-world group, not built
                assert value.startswith("RuntimeError") and "build_topologies" in value
                continue
            assert value["two_level"] == value["expected_two_level"], f"rank {rank} rpn={rpn}"
            assert value["passthrough_exact"], f"rank {rank} rpn={rpn}"
            assert value["ratio"] <= 1.0, f"rank {rank} rpn={rpn}: {value}"
    if world == 8:  # 2 nodes x 2 members of each DP group: the two-level path ran
        assert any(per_case[(4, "built")]["two_level"] for per_case in results)


# --- refusals ------------------------------------------------------------------------------

@battery.case(*TWO_GROUP_WORLDS)
def uneven_nodes(rank: int, world: int) -> dict:
    """Uneven nodes: flat fallback that still reduces correctly, or ValueError when strict."""
    rpn = world - 1  # e.g. 4 ranks on nodes of 3: sizes 3 and 1
    topo = get_topology(None, ranks_per_node=rpn)
    config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, pipeline_chunks=2)
    x = make_input(rank, 71, world * 500, torch.float32, integers=False)
    result = run_reduce_scatter(x, config, dist.ReduceOp.SUM)
    # Ranks that disagree on ranks_per_node all get the same error, not a hang.
    # (Values no other case uses: the check runs when a topology is first built.)
    odd_one_out = world + 1 if rank == 0 else world + 2
    return {
        "fallback": {"reason": topo.fallback_reason, "two_level": topo.is_two_level,
                     **compare_with_bound(x, result, config, dist.ReduceOp.SUM, None,
                                          num_nodes=world)},
        "strict": error_text(lambda: get_topology(None, ranks_per_node=rpn, strict=True)),
        "strict_build": error_text(
            lambda: build_topologies([list(range(world))], ranks_per_node=rpn, strict=True)),
        "disagree": error_text(lambda: get_topology(None, ranks_per_node=odd_one_out)),
        "disagree_build": error_text(
            lambda: build_topologies([list(range(world))], ranks_per_node=odd_one_out)),
    }


def test_uneven_nodes_fall_back_or_raise(world):
    if world < 4:
        pytest.skip("2 ranks cannot be split into unequal nodes; runs at 4 and 8 ranks")
    for per_rank in battery.results(uneven_nodes, world):
        fallback = per_rank["fallback"]
        assert "unevenly" in fallback["reason"] and not fallback["two_level"]
        assert fallback["ratio"] <= 1.0, "the flat fallback must still reduce correctly"
        assert per_rank["strict"].startswith("ValueError") and "ranks_per_node" in per_rank["strict"]
        # the layer's install: refused on every rank, naming where the group's ranks run
        strict = per_rank["strict_build"]
        assert strict.startswith("ValueError") and "unevenly" in strict, strict
        assert "hosts: " in strict and "ranks 0, 1" in strict and "--sdp4bit-ranks-per-node 1" in strict, strict
        for key in ("disagree", "disagree_build"):
            assert per_rank[key].startswith("ValueError: ranks disagree"), per_rank[key]


@battery.case(*WORLDS)
def bad_input(rank: int, world: int) -> dict:
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
    return {name: error_text(fn) for name, fn in checks.items()}


def test_bad_input_raises_value_error_that_says_what_to_change(world):
    expected = {"rs_numel": "DP size", "rs_op": "ReduceOp.SUM", "rs_dtype": "float32",
                "rs_mixed": "share dtype", "rs_strided": "contiguous",
                "ag_numel": "DP size", "ag_dtype": "float32"}
    for rank, messages in enumerate(battery.results(bad_input, world)):
        assert set(messages) == set(expected)
        for name, message in messages.items():
            assert message.startswith("ValueError") and expected[name] in message, \
                f"rank {rank} {name}: {message!r}"


# --- subgroups forgotten and built again (a world of its own: it drops every subgroup) -------

def _forget_and_rebuild(rank: int, world: int) -> dict:
    from megatron_sdp4bit import comm

    before = comm.get_topology(dist.group.WORLD, 2)
    comm.forget_subgroups()
    after = comm.get_topology(dist.group.WORLD, 2)  # collective: new subgroups, every rank
    x = torch.arange(world * 256, dtype=torch.float32) * (rank + 1)
    out = torch.empty(256)
    comm.quantized_reduce_scatter(out, x, config=SDP4BitConfig(ranks_per_node=2, rounding="nearest"))
    exact = torch.arange(rank * 256, (rank + 1) * 256, dtype=torch.float32) * sum(range(1, world + 1))
    comm.forget_subgroups()  # what shutdown does before destroy_process_group
    return {"rebuilt": after is not before and after.intra_group is not before.intra_group,
            "two_level": after.is_two_level,
            # within a 4-bit step of the largest value: the hops ran on the new subgroups
            "close": float((out - exact).abs().max()) <= float(exact.abs().max()) / 7}


def test_forgotten_subgroups_are_built_again_on_demand():
    """``forget_subgroups`` (the driver's shutdown calls it before destroying the process
    group, so that no group outlives it) leaves comm usable: the next collective builds
    its subgroups again."""
    for result in spawn_ranks(_forget_and_rebuild, 4, start="forkserver"):
        assert result == {"rebuilt": True, "two_level": True, "close": True}
