"""Topology on real gloo ranks: subgroups, strided DP groups, bad topology, bad input."""
from __future__ import annotations

import pytest

from comm_battery import ranks_per_node_choices
from comm_results import cases, world_results

pytestmark = pytest.mark.slow  # real gloo processes


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


def test_topology_shape_and_subgroups(results, world):
    for rpn in ranks_per_node_choices(world):
        for rank, per_rank in enumerate(results):
            got = per_rank[f"topo|rpn={rpn}"]
            want = _expected(world, rpn, rank)
            assert {k: got[k] for k in want} == want, f"rank {rank} rpn={rpn}: {got}"
            assert got["dp_size"] == world and got["fallback"] is None and got["cached"]


def test_strided_dp_groups(world):
    """DP groups [0,2,..] / [1,3,..]: built from their own rank lists, exact and bounded."""
    if world < 4:
        pytest.skip("2 ranks cannot form two strided DP groups of 2+ members; runs at 4 and 8 ranks")
    results = world_results(world)
    for rank, key, value in cases(results, "strided|"):
        if key.endswith("|unbuilt"):  # two-level subgroups of a non-world group, not built
            assert value.startswith("RuntimeError") and "build_topologies" in value
            continue
        assert value["two_level"] == value["expected_two_level"], f"rank {rank} {key}"
        assert value["passthrough_exact"], f"rank {rank} {key}"
        assert value["ratio"] <= 1.0, f"rank {rank} {key}: {value}"
    if world == 8:  # 2 nodes x 2 members of each DP group: the two-level path ran
        assert any(v["two_level"] for _, k, v in cases(results, "strided|rpn=4")
                   if not k.endswith("|unbuilt"))


def test_uneven_nodes_fall_back_or_raise(world):
    if world < 4:
        pytest.skip("2 ranks cannot be split into unequal nodes; runs at 4 and 8 ranks")
    for rank, per_rank in enumerate(world_results(world)):
        fallback = per_rank["bad|fallback"]
        assert "unevenly" in fallback["reason"] and not fallback["two_level"]
        assert fallback["ratio"] <= 1.0, "the flat fallback must still reduce correctly"
        assert per_rank["bad|strict"].startswith("ValueError") and \
            "ranks_per_node" in per_rank["bad|strict"]
        for key in ("bad|disagree", "bad|disagree_build"):
            assert per_rank[key].startswith("ValueError: ranks disagree"), per_rank[key]


def test_bad_input_raises_value_error_that_says_what_to_change(results):
    expected = {"rs_numel": "DP size", "rs_op": "ReduceOp.SUM", "rs_dtype": "float32",
                "rs_mixed": "share dtype", "rs_strided": "contiguous",
                "ag_numel": "DP size", "ag_dtype": "float32"}
    for rank, key, message in cases(results, "badinput|"):
        name = key.split("|")[1]
        assert message.startswith("ValueError") and expected[name] in message, \
            f"rank {rank} {name}: {message!r}"
    assert len(cases(results, "badinput|")) == len(expected) * len(results)


def _forget_and_rebuild(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_sdp4bit import comm
    from megatron_sdp4bit.config import SDP4BitConfig

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
    from comm_harness import run_world

    for result in run_world(_forget_and_rebuild, 4):
        assert result == {"rebuilt": True, "two_level": True, "close": True}
