"""comm/connect.py on real gloo ranks: every group a topology's collectives use answers
once at install, in an order every rank can follow whatever other groups it is in, and a
group whose members answer out of order is named in the error.

On NCCL the same calls set up the communicators (not run here: no GPUs); on gloo they
run the same collectives, so an order that could deadlock would hang here too.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch.distributed as dist

from comm_worlds import battery
from megatron_sdp4bit.comm import build_topologies, forget_subgroups, get_topology
from megatron_sdp4bit.comm import connect as connect_module
from megatron_sdp4bit.comm.connect import connect, topology_groups

pytestmark = pytest.mark.slow  # real gloo processes


@battery.case(4, 8)
def connected_groups(rank: int, world: int) -> dict:
    """Two DP groups of contiguous halves (as pipeline parallelism of 2 makes them; other
    lists than the topology cases', whose ``build_topologies`` must come first), at 2 and
    4 ranks per node: the groups each rank connected, in order, and what a second call
    adds. The subgroups are forgotten afterwards, for the cases that follow."""
    half = world // 2
    lists = [list(range(0, half)), list(range(half, world))]
    groups = [dist.new_group(ranks) for ranks in lists]  # every rank creates both
    out = {}
    for rpn in (2, 4):
        build_topologies(lists, ranks_per_node=rpn)
        topology = get_topology(groups[rank // half], ranks_per_node=rpn)
        done: list = []
        connect(topology, "cpu", done)
        first = [dist.get_process_group_ranks(g) for g in done]
        connect(topology, "cpu", done)
        out[rpn] = {"connected": first, "again": len(done) - len(first),
                    "levels": [dist.get_process_group_ranks(g) for g in topology_groups(topology)],
                    "two_level": topology.is_two_level}
    forget_subgroups()
    return out


@pytest.mark.parametrize("world", [4, 8])  # two DP groups of 2 or more ranks each
def test_every_group_of_a_topology_is_connected_once_in_the_topologys_order(world):
    half = world // 2
    two_levels = 0
    for rank, per_rpn in enumerate(battery.results(connected_groups, world)):
        mine = list(range(0, half)) if rank < half else list(range(half, world))
        for rpn, got in per_rpn.items():
            assert got["connected"] == got["levels"], (rank, rpn, got)
            assert got["again"] == 0
            assert got["connected"][-1] == mine  # the DP group itself, after its hops
            assert all(set(ranks) <= set(mine) and rank in ranks for ranks in got["connected"])
            if got["two_level"]:  # the hop inside the node, then the one across nodes
                two_levels += 1
                inside, across = got["connected"][:2]
                assert len(inside) == rpn and len(across) == len(mine) // rpn
    assert two_levels == (world if world == 8 else 0)  # 8 ranks, 2 per node: 2 nodes a group


@battery.case(4)
def misordered_group(rank: int, world: int) -> str:
    """A group whose rank list disagrees with the members' answers (a stand-in for a rank
    that joined another job's group): the error names it."""
    topology = get_topology(None, ranks_per_node=world)
    listed = list(reversed(dist.get_process_group_ranks(topology.group)))
    with mock.patch.object(connect_module.dist, "get_process_group_ranks", return_value=listed):
        try:
            connect(topology, "cpu", [])
        except RuntimeError as error:
            return str(error)
    return "no error"


def test_a_group_whose_members_answer_out_of_order_is_named():
    for text in battery.results(misordered_group, 4):
        assert "process group [3, 2, 1, 0] returned ranks [0, 1, 2, 3]" in text, text
