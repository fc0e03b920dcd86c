"""Bytes of the collectives megatron runs itself, so the wire totals stay complete."""
from __future__ import annotations

from megatron_sdp4bit.comm.topology import peer_split


def record_exact(layer, bucket_group, collective: str, buffers) -> None:
    group, size, _rank = layer.adapter.collective_group(bucket_group)
    same, other = peer_split(group, layer.state.config.ranks_per_node)
    wire = layer.state.wire
    wire.call(collective)
    for buffer in buffers:
        if buffer is None:
            continue
        shard = buffer.numel() // size
        nbytes = shard * buffer.element_size()
        wire.peer_sends(collective, same, other, exact=nbytes, values=nbytes, elements=shard)
