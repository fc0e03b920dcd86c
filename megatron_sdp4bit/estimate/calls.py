"""How many collective calls and messages one bucket's collectives make on one rank.

Latency is paid per call and per message (``network.Latency``), so it depends on
how an implementation (``implementation.py``) splits a bucket: the quantized
reduce-scatter into pipeline chunks (``volume.grad_chunks``), each hop into
``messages_per_peer`` all-to-alls; the quantized all-gather into slices (a
synchronous gather in ``comm/weights.py``) of ``messages_per_peer`` ring
all-gathers each, or two on a two-level layout (``comm/gather_hops.py``: across
nodes, then inside the node). The exact collectives are one NCCL call each.
"""
from __future__ import annotations

from megatron_sdp4bit.comm.layout import NodeLayout
from megatron_sdp4bit.comm.layout import weight_slices as layout_weight_slices
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.estimate import volume
from megatron_sdp4bit.estimate.implementation import Implementation
from megatron_sdp4bit.estimate.network import Calls, alltoall_calls, ring_calls


def _ring(layout: NodeLayout, calls: int = 1, rounds: int = 1) -> Calls:
    return ring_calls(layout.dp_size, layout.num_nodes, calls, rounds)


def _flat_peers(layout: NodeLayout) -> tuple:
    rank = layout.ranks[0]
    same = layout.same_node_peers(rank)
    return same, layout.dp_size - 1 - same


def reduce_scatter_calls(shard: int, layout: NodeLayout, config: SDP4BitConfig,
                         exact_algorithm: str, impl: Implementation) -> Calls:
    """Calls of one gradient reduce-scatter of shards of ``shard`` elements."""
    if layout.dp_size == 1 or shard == 0:
        return Calls()
    if not config.quantize_grads:
        if exact_algorithm == "alltoall":
            return alltoall_calls(*_flat_peers(layout), calls=1)
        return _ring(layout, rounds=2 if exact_algorithm == "allreduce" else 1)
    per_chunk = Calls()
    hops = volume.hop_levels(layout)
    for level, members in hops:
        if len(hops) == 1:
            same, other = _flat_peers(layout)
        else:
            same, other = (members - 1, 0) if level == "intra" else (0, members - 1)
        per_chunk = per_chunk + alltoall_calls(same, other, impl.messages_per_peer)
    return per_chunk.times(len(volume.grad_chunks(shard, layout, config, impl)))


def weight_slices(shard: int, layout: NodeLayout, config: SDP4BitConfig,
                  impl: Implementation) -> int:
    """Slices a quantized all-gather of this shard runs in (``comm.layout.weight_slices``,
    what ``comm/weights.py`` runs, overlapped or not: slices of whole groups; one where the
    runner takes the bucket whole)."""
    if (not impl.sliced_weight_gather or impl.max_chunk_elements is None
            or impl.takes_whole(shard, layout.dp_size)):
        return 1
    return len(layout_weight_slices(shard, layout.dp_size, config.weight_group_size, False,
                                    impl.max_chunk_elements, impl.min_slice_elements))


def all_gather_calls(shard: int, layout: NodeLayout, config: SDP4BitConfig,
                     impl: Implementation) -> Calls:
    """Calls of one weight all-gather."""
    if layout.dp_size == 1 or shard == 0:
        return Calls()
    if not config.quantize_weights:
        return _ring(layout)
    slices = weight_slices(shard, layout, config, impl)
    if volume.two_level_gather(layout, config, impl):  # across nodes, then inside the node
        calls = slices * impl.messages_per_peer
        return (ring_calls(layout.num_nodes, layout.num_nodes, calls)
                + ring_calls(layout.members_per_node, 1, calls))
    return _ring(layout, calls=slices * impl.messages_per_peer)


def staging_elements(shard: int, layout: NodeLayout, config: SDP4BitConfig,
                     impl: Implementation) -> int:
    """Elements the reduce-scatter copies into send order before its first hop (an fp32
    read and write each; ``comm/gradients.stage_chunk_rows``): every chunk's rows of all
    shards, unless they are the bucket itself, in order and unpadded."""
    if (not impl.staging_copy or not config.quantize_grads or layout.dp_size == 1
            or shard == 0):
        return 0
    chunks = volume.grad_chunks(shard, layout, config, impl)
    two_level = len(volume.hop_levels(layout)) == 2
    return sum(layout.dp_size * c.padded for c in chunks
               if two_level or len(chunks) > 1 or c.valid < c.padded)
