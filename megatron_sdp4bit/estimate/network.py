"""The links of a cluster: rates, how many concurrent streams fill a node's NICs, latencies.

A phase of a collective moves ``volume.Links``: bytes per GPU over intra-node
links and bytes per node over its network links. Its time is

    max(busiest GPU's intra bytes / intra rate,
        max over nodes of node bytes / min(node rate, streams x stream rate))

where a node's *streams* are the independent senders of its inter-node bytes:
one per ring communicator (DP group) with members on the node, one per GPU
that sends in an all-to-all hop. ``stream_gbps`` is the most one stream
reaches on its own: a node whose NICs one ring cannot fill (measured on the
paper's A100 cluster, docs/performance.md "Validation (b)") reaches its full
rate only with several streams (tensor parallelism puts one DP group per GPU
on a node; an all-to-all hop sends from every GPU). None: one stream fills the
node.

Latency (``Latency``) follows NCCL's own cost model (src/graph/tuning.cc,
Simple protocol): a call costs ``call_us``, a ring step ``intra_us`` between
GPUs of a node and ``inter_us`` across nodes, and a ring of P ranks over N
nodes takes P - N intra and N - 1 inter steps. An all-to-all (NCCL's grouped
sends and receives) posts every message at once: one traversal (``inter_us``
when a peer is on another node, else ``intra_us``) plus ``message_us`` for
each message the network proxy posts (NCCL's per-operation network overhead),
so a hop to 15 other nodes pays 15 posts, not 15 traversals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Latency:
    call_us: float     # per collective call (launch, NCCL's base latency)
    intra_us: float    # per ring step or traversal between GPUs of one node
    inter_us: float    # per ring step or traversal across nodes
    message_us: float  # per message posted to the network (all-to-all sends)

    def seconds(self, calls: "Calls") -> float:
        return (calls.calls * self.call_us + calls.intra_steps * self.intra_us
                + calls.inter_steps * self.inter_us + calls.messages * self.message_us) * 1e-6


#: NCCL's tuning model, Simple protocol (src/graph/tuning.cc at commit b647562): baseLat of
#: a ring 8.4 us, hwLat of a ring step 3.4 us over NVLink and 14.0 us over the network, and
#: the network post overhead (getNetOverhead) of 1 us on Intel hosts x 3 for Simple.
NCCL_LATENCY = Latency(call_us=8.4, intra_us=3.4, inter_us=14.0, message_us=3.0)
NO_LATENCY = Latency(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Calls:
    """Collective calls of one phase on one rank: the steps they wait for one after another
    (ring steps, all-to-all traversals) and the inter-node messages they post."""

    calls: int = 0
    intra_steps: int = 0
    inter_steps: int = 0
    messages: int = 0

    def __add__(self, other: "Calls") -> "Calls":
        return Calls(self.calls + other.calls, self.intra_steps + other.intra_steps,
                     self.inter_steps + other.inter_steps, self.messages + other.messages)

    def times(self, n: int) -> "Calls":
        return Calls(self.calls * n, self.intra_steps * n, self.inter_steps * n,
                     self.messages * n)


def ring_calls(members: int, nodes: int, calls: int = 1, rounds: int = 1) -> Calls:
    """``calls`` ring collectives over ``members`` ranks on ``nodes`` nodes (NCCL's step
    count; ``rounds`` 2 for an all-reduce)."""
    if members < 2:
        return Calls()
    inter = nodes - 1 if nodes > 1 else 0
    return Calls(calls, calls * rounds * (members - 1 - inter), calls * rounds * inter)


def alltoall_calls(same_node_peers: int, other_node_peers: int, calls: int) -> Calls:
    """``calls`` all-to-alls, each posting one message to every peer at once."""
    if same_node_peers + other_node_peers == 0:
        return Calls()
    if other_node_peers:
        return Calls(calls, 0, calls, calls * other_node_peers)
    return Calls(calls, calls, 0, 0)


@dataclass(frozen=True)
class Network:
    intra_gbps: float             # per GPU, each direction
    inter_gbps: float             # per node, all its NICs, each direction (what they reach)
    stream_gbps: Optional[float]  # most one stream reaches per node (None: inter_gbps)
    latency: Latency = NCCL_LATENCY

    def node_gbps(self, streams: int) -> float:
        if self.stream_gbps is None:
            return self.inter_gbps
        return min(self.inter_gbps, max(1, streams) * self.stream_gbps)

    def phase_seconds(self, links) -> float:
        """Time of one phase's bytes (``volume.Links``) on these links, bandwidth only."""
        intra = links.max_gpu_intra * 8 / (self.intra_gbps * 1e9)
        inter = max((nbytes * 8 / (self.node_gbps(links.node_streams.get(node, 1)) * 1e9)
                     for node, nbytes in links.node_inter.items()), default=0.0)
        return max(intra, inter)
