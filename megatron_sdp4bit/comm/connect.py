"""Open a topology's process groups before the first step, not inside it.

NCCL creates a communicator, and the connections of each kind of collective, on
the group's first collective of that kind, collectively over the group's members,
blocking the host and allocating device memory. For the layer's subgroups the
first collectives come from inside the first backward pass (a megatron grad hook,
or the runner's side stream), while megatron's other communicators are busy;
NCCL warns that its set-up can then stall for seconds or deadlock on implicit
device syncs. ``connect`` runs each kind of collective the layer uses (an
all-to-all: the reduce-scatter's hops; an all-gather into one tensor: the weight
gather's) once on every group of a topology, at install, where nothing else is in
flight, and checks what comes back: every member answers, in the order the
topology counts them. On gloo the connections exist already and this is that
check, in a few milliseconds.

Every rank calls it with the same topologies in the same order; a rank visits its
groups in the topology's order (the hop inside the node, then the hop across
nodes, then the DP group), so the members of one group meet there whatever other
groups they are in.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.primitives import all_gather_flat, all_to_all_equal
from megatron_sdp4bit.comm.topology import Topology


def topology_groups(topology: Topology) -> List[object]:
    """The groups ``topology``'s collectives use, in the order ``connect`` visits them."""
    groups = [level.group for level in topology.levels]
    if topology.group is not None and all(topology.group is not g for g in groups):
        groups.append(topology.group)
    return groups


def connect(topology: Topology, device: torch.device, done: list) -> None:
    """One all-to-all and one all-gather on each of ``topology``'s groups not in ``done``
    (the groups connected before; appended to), on ``device``. Raises RuntimeError
    naming the group when its members do not answer as its rank list says."""
    device = torch.device(device)
    for group in topology_groups(topology):
        if any(group is known for known in done):
            continue
        ranks = dist.get_process_group_ranks(group)
        me = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
        gathered = torch.empty(len(ranks), dtype=torch.int64, device=device)
        all_gather_flat(gathered, me, group, async_op=False)
        # rank i's entry j says "i sent this to j": after the all-to-all, entry i is i's rank
        outgoing = me.repeat(len(ranks))
        incoming = torch.empty_like(outgoing)
        all_to_all_equal(incoming, outgoing, group, async_op=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for kind, answer in (("all-gather", gathered), ("all-to-all", incoming)):
            if answer.tolist() != list(ranks):
                raise RuntimeError(
                    f"SDP4Bit: the {kind} over process group {list(ranks)} returned ranks "
                    f"{answer.tolist()}; every member must answer, in the group's rank order. "
                    "Check that every rank runs the same job with the same parallel sizes")
        done.append(group)
