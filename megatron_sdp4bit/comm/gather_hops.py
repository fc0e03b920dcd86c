"""How a quantized weight all-gather moves its segments: one flat gather, or two hops.

Every rank's quantized segment must reach every other rank. A flat all-gather over
the P = N nodes x L ranks of a two-level topology (``comm/topology.py``) runs as a
ring (NCCL's and gloo's), and a ring carries (P - 1)/P of the whole gather over each
node's link. Two hops carry (N - 1)/N of it, the least any all-gather can:

1. **across nodes**, among the N ranks of one local index (the topology's inter-node
   group): each rank gets its N counterparts' segments;
2. **inside the node** (the intra-node group): each rank gets its L peers' N segments.

With 2 nodes that is 1/2 of the gather on the link instead of (P - 1)/P (3/4 for
2 x 2 ranks, 15/16 for 2 x 8); the inside hop runs on the node's own links.

The second hop leaves the segments ordered by (local index, node): the order of the
reduce-scatter's first hop (``Topology.send_order``), so one copy by that index puts
them in DP-rank order. The segments are the same bytes either way: the weights come
out bit-identical to the flat gather's.

A gather is started (``start``: the hop across nodes, asynchronous), then exchanged
(``exchange``: wait for it, start the hop inside the node) and applied (``wait``).
Collectives are issued only in ``start`` and ``exchange``: a thread runner may run a
job's last ``wait`` after the next job's first collectives (``comm/runner.py``), and
every rank must issue each group's collectives in the same order. So a call's last
slice is exchanged in the call's body: on a thread runner the next job's first
quantization then waits for that slice's hop across nodes (on gloo the wait blocks
the worker; on a side stream it blocks nothing), where a flat gather's would overlap it.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_sdp4bit.comm.buffer_names import weights_by_local_rank
from megatron_sdp4bit.comm.primitives import all_gather_flat
from megatron_sdp4bit.comm.topology import Topology
from megatron_sdp4bit.comm.workspace import Workspace


class GatherHops:
    """One group's way to gather equal segments: ``two_level`` or flat over ``group``."""

    def __init__(self, group, topology: Optional[Topology]):
        self.group = group
        self.topology = topology if topology is not None and topology.is_two_level else None

    @property
    def two_level(self) -> bool:
        return self.topology is not None

    def peer_sends(self, wire, collective: str, same: int, other: int, **per_segment: int) -> None:
        """Count what this rank sends for one segment of ``per_segment`` amounts: flat,
        the segment to each of its ``same``-node and ``other``-node peers; two levels, the
        segment to its counterparts on the other nodes, then its node's N segments to
        its peers on the node."""
        if self.topology is None:
            wire.peer_sends(collective, same, other, **per_segment)
            return
        nodes = self.topology.num_nodes
        wire.peer_sends(collective, 0, nodes - 1, **per_segment)
        wire.peer_sends(collective, self.topology.ranks_per_node - 1, 0,
                        **{name: nodes * amount for name, amount in per_segment.items()})

    def start(self, incoming: torch.Tensor, outgoing: torch.Tensor, space: Workspace,
              slot: int) -> "InFlight":
        """Start gathering every rank's ``outgoing`` into ``incoming`` (DP-rank order)."""
        if self.topology is None:
            return InFlight(all_gather_flat(incoming, outgoing, self.group, True))
        topology, nbytes = self.topology, outgoing.numel()
        by_local = space.buffer(weights_by_local_rank(slot), incoming.numel(), outgoing.device)
        # The hop across nodes writes this rank's row of the hop inside the node (rows by
        # local index, N segments each), so that hop runs in place (input = output's own
        # row, as NCCL and gloo allow) and needs no buffer of its own.
        row = topology.num_nodes * nbytes
        across = by_local[topology.local_rank * row:(topology.local_rank + 1) * row]
        work = all_gather_flat(across, outgoing, topology.inter_group, True)
        return InFlight(work, _InsideNode(topology, across, by_local, incoming))


class InFlight:
    """A gather started: ``exchange()`` issues what is left of it, ``wait()`` completes it."""

    def __init__(self, work, inside: Optional["_InsideNode"] = None):
        self.work, self.inside = work, inside

    def exchange(self) -> None:
        """Issue the gather's last collective (nothing for a flat gather); idempotent."""
        if self.inside is not None and not self.inside.started:
            self.work.wait()
            self.work = self.inside.start()

    def wait(self) -> None:
        """Every rank's segment in ``incoming``, in DP-rank order."""
        self.exchange()
        self.work.wait()
        if self.inside is not None:
            self.inside.reorder()


class _InsideNode:
    """The hop inside the node, and the copy into DP-rank order after it."""

    def __init__(self, topology: Topology, across: torch.Tensor, by_local: torch.Tensor,
                 incoming: torch.Tensor):
        self.topology, self.across, self.by_local, self.incoming = (
            topology, across, by_local, incoming)
        self.started = False

    def start(self):
        self.started = True
        return all_gather_flat(self.by_local, self.across, self.topology.intra_group, True)

    def reorder(self) -> None:
        rows = self.topology.dp_size
        order = self.topology.send_order_index(self.incoming.device)
        gathered = self.by_local.view(rows, -1)
        if order is None:
            self.incoming.view(rows, -1).copy_(gathered)
        else:
            self.incoming.view(rows, -1).index_copy_(0, order, gathered)
