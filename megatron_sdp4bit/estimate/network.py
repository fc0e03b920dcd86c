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
nodes takes P - N intra and N - 1 inter steps; an all-to-all sends each peer
its message one after another (pairwise exchange, Thakur, Rabenseifner and
Gropp, IJHPCA 2005), so a hop of m members pays m - 1 message latencies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Latency:
    call_us: float   # per collective call (launch, NCCL's base latency)
    intra_us: float  # per message or ring step between GPUs of one node
    inter_us: float  # per message or ring step across nodes

    def seconds(self, calls: int, intra_messages: int, inter_messages: int) -> float:
        return (calls * self.call_us + intra_messages * self.intra_us
                + inter_messages * self.inter_us) * 1e-6


#: NCCL 2.19's tuning model, Simple protocol (src/graph/tuning.cc): baseLat of a ring
#: 8.4 us, hwLat of a ring step 3.4 us over NVLink and 14.0 us over the network.
NCCL_LATENCY = Latency(call_us=8.4, intra_us=3.4, inter_us=14.0)
NO_LATENCY = Latency(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Calls:
    """Collective calls of one phase on one rank, and the messages (ring steps) they wait for."""

    calls: int = 0
    intra_messages: int = 0
    inter_messages: int = 0

    def __add__(self, other: "Calls") -> "Calls":
        return Calls(self.calls + other.calls, self.intra_messages + other.intra_messages,
                     self.inter_messages + other.inter_messages)

    def times(self, n: int) -> "Calls":
        return Calls(self.calls * n, self.intra_messages * n, self.inter_messages * n)


def ring_calls(members: int, nodes: int, calls: int = 1, rounds: int = 1) -> Calls:
    """``calls`` ring collectives over ``members`` ranks on ``nodes`` nodes (NCCL's step
    count; ``rounds`` 2 for an all-reduce)."""
    if members < 2:
        return Calls()
    inter = nodes - 1 if nodes > 1 else 0
    return Calls(calls, calls * rounds * (members - 1 - inter), calls * rounds * inter)


def alltoall_calls(same_node_peers: int, other_node_peers: int, calls: int) -> Calls:
    """``calls`` all-to-alls, each sending one message to every peer in turn."""
    if same_node_peers + other_node_peers == 0:
        return Calls()
    return Calls(calls, calls * same_node_peers, calls * other_node_peers)


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
