"""The names of the workspace's buffers (``comm/workspace.py``): one source for the
collectives that take them and for ``comm/memory_plan.py``, which predicts what they take.

Consecutive chunks (or weight slices) alternate between two slots, so a chunk fills
its send buffer while the previous chunk's is still on the wire; a third chunk reuses
the first one's buffers once that chunk is done.
"""
from __future__ import annotations

GRADS_SUM = "grads sum"
"""The fp32 sum of a shard's unaligned end (the reduce-scatter's last chunk)."""

SLOTS = 2


def grads_hop(hop: int, direction: str, chunk_index: int) -> str:
    """The reduce-scatter's ``direction`` ("send" or "receive") buffer of ``hop`` (0: the
    intra-node hop, or the only one) for the chunk at ``chunk_index``."""
    if direction not in ("send", "receive"):
        raise ValueError(f"direction {direction!r} must be 'send' or 'receive'")
    return f"grads hop {hop} {direction} {chunk_index % SLOTS}"


def weights_send(slice_index: int) -> str:
    """This rank's quantized segment of the weight slice at ``slice_index``."""
    return f"weights send {slice_index % SLOTS}"


def weights_gather(slice_index: int) -> str:
    """Every rank's segments of the weight slice at ``slice_index``, gathered."""
    return f"weights gather {slice_index % SLOTS}"


def weights_by_local_rank(slice_index: int) -> str:
    """Two levels: every rank's segments as the hop inside the node leaves them, by local
    index then node, before the copy into DP-rank order; this rank's row is written by
    the hop across nodes first (``comm/gather_hops.py``)."""
    return f"weights by local rank {slice_index % SLOTS}"
