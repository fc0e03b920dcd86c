"""Nodes learned from the hosts on 4 real gloo ranks without LOCAL_WORLD_SIZE; hosts are
emulated through the documented override, ``SDP4BIT_HOST_ID``."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from harness import spawn_ranks

pytestmark = pytest.mark.slow  # real gloo processes

SCENARIOS = {  # name -> (host of each rank, LOCAL_WORLD_SIZE, ranks_per_node given)
    "two hosts": (["n0", "n0", "n1", "n1"], None, None),
    "one host": (["n0"] * 4, None, None),
    "one host, flag 2": (["n0"] * 4, None, 2),
    "three and one": (["n0", "n0", "n0", "n1"], None, None),
    "launcher disagrees": (["n0", "n0", "n1", "n1"], "4", None),
}


def _detect(rank: int, world: int) -> dict:
    from megatron_sdp4bit import comm
    from megatron_sdp4bit.comm.topology import default_ranks_per_node

    out = {}
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.environ.pop("SDP4BIT_HOST_ID", None)
    out["real host"] = default_ranks_per_node()  # one machine: hostname + boot id agree
    for name, (hosts, local, flag) in SCENARIOS.items():
        comm.forget_subgroups()  # and the gathered hosts: detect afresh
        os.environ["SDP4BIT_HOST_ID"] = hosts[rank]
        if local is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = local
        try:
            rpn = default_ranks_per_node(flag)
        except ValueError as refused:
            out[name] = str(refused)
            continue
        topology = comm.get_topology(dist.group.WORLD)  # None: the detected layout
        out[name] = (rpn, topology.num_nodes, topology.is_two_level)
    # The layer decides its ranks_per_node so at install (LayerState.resolve_ranks_per_node)
    from megatron_sdp4bit.config import SDP4BitConfig
    from megatron_sdp4bit.megatron.state import LayerState

    comm.forget_subgroups()
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.environ["SDP4BIT_HOST_ID"] = SCENARIOS["two hosts"][0][rank]
    for flag in (None, 1):
        state = LayerState(SDP4BitConfig(ranks_per_node=flag))
        state.resolve_ranks_per_node()
        out[f"layer, flag {flag}"] = state.config.ranks_per_node
    comm.forget_subgroups()
    return out


def test_nodes_come_from_the_hosts_and_bad_layouts_are_refused_in_one_line():
    results = spawn_ranks(_detect, 4, start="forkserver")
    assert all(result == results[0] for result in results)  # every rank decides alike
    got = results[0]
    assert got["real host"] == 4
    assert got["two hosts"] == (2, 2, True)
    assert got["one host"] == (4, 1, False)
    assert got["one host, flag 2"][0] == 2
    assert got["three and one"].startswith(
        "hosts hold unequal numbers of ranks (ranks 0-2 on 'n0', ranks 3 on 'n1')")
    assert got["launcher disagrees"].startswith("LOCAL_WORLD_SIZE=4 but the hosts hold 2 ranks each")
    assert (got["layer, flag None"], got["layer, flag 1"]) == (2, 1)
    assert all("\n" not in got[name] for name in ("three and one", "launcher disagrees"))
