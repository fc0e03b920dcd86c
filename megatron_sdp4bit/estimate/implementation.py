"""How the quantized collectives being modelled split their work into calls and messages.

The byte counts (``volume.py``) do not depend on this; the latency and the
staging copy do. Two implementations are described:

- ``THIS_PROJECT``: ``megatron_sdp4bit.comm``: each quantized hop and each
  weight all-gather sends its codes and scales in one buffer, the first
  hop's quantize reads the rows in send order itself, and the quantized weight
  all-gather takes the reduce-scatter's two levels. The two lines to change
  when that changes are ``MESSAGES_PER_PEER`` and ``STAGING_COPY`` below.
- ``PAPER_REFERENCE``: the SDP4Bit paper's reference code (a Megatron-LM fork,
  January 2024), for ``--check-paper``: codes and scales in two calls per hop
  and per weight all-gather, the bucket split only into ``--gradient-alltoall-
  pipeline`` chunks, and the send-order ("swizzle") copy fused into its
  quantize kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_sdp4bit.comm.layout import (MAX_CHUNK_ELEMENTS, MIN_CHUNK_SHARD_ELEMENTS,
                                          MIN_SLICE_ELEMENTS, whole_bucket)

#: Messages one quantized all-to-all hop, or one quantized all-gather, sends each peer.
#: 1: codes and scales in one buffer (comm/gradients.py, comm/weights.py: quant.wire_view).
MESSAGES_PER_PEER = 1

#: Whether the reduce-scatter copies each chunk's rows into send order before its first
#: hop (an fp32 read and write, 8 bytes per element, on two-level topologies and for
#: padded chunks). False: the quantize kernel reads the rows in send order itself
#: (quant.hadamard_quantize_rows), as comm/gradients.py does.
STAGING_COPY = False


@dataclass(frozen=True)
class Implementation:
    name: str
    messages_per_peer: int
    """Calls (each one message per peer) per all-to-all hop and per all-gather slice."""
    max_chunk_elements: Optional[int]
    """Reduce-scatter chunks hold at most this many elements over all shards (more chunks
    than --pipeline-chunks where needed); None: exactly --pipeline-chunks chunks."""
    sliced_weight_gather: bool
    """A synchronous quantized all-gather runs in slices of ``max_chunk_elements`` over all
    ranks (comm/weights.py); False: one gather per bucket."""
    staging_copy: bool
    """The reduce-scatter's send-order copy is a pass of its own (see ``STAGING_COPY``)."""
    min_chunk_shard_elements: int = MIN_CHUNK_SHARD_ELEMENTS
    """Reduce-scatter chunks hold at least this many elements of each shard
    (``comm.layout.chunk_count``); 1 for none."""
    min_slice_elements: int = MIN_SLICE_ELEMENTS
    """A synchronous all-gather's slices hold at least this many elements per rank."""
    two_level_weight_gather: bool = False
    """On a two-level layout the quantized all-gather runs in two hops, across nodes among
    one local index's ranks, then inside the node (comm/gather_hops.py); False: one ring
    over the DP group."""
    whole_bucket_elements: Optional[int] = None
    """A collective over at most this many elements (all shards) runs as one chunk and one
    slice, whatever ``max_chunk_elements`` says: the runner's limit (``comm.layout.
    whole_bucket``; ``ONE_QUEUE_WHOLE_BUCKET_ELEMENTS`` on the runner for one hardware
    queue, ``comm/deferring_runner.py``); None: never."""

    def takes_whole(self, shard: int, dp: int) -> bool:
        """Whether a collective of ``dp`` shards of ``shard`` elements runs as one chunk
        and one slice (``whole_bucket_elements``)."""
        return whole_bucket(dp * shard, self.whole_bucket_elements)


THIS_PROJECT = Implementation(
    name="megatron_sdp4bit.comm", messages_per_peer=MESSAGES_PER_PEER,
    max_chunk_elements=MAX_CHUNK_ELEMENTS, sliced_weight_gather=True, staging_copy=STAGING_COPY,
    two_level_weight_gather=True)

PAPER_REFERENCE = Implementation(
    name="the paper's reference code", messages_per_peer=2, max_chunk_elements=None,
    sliced_weight_gather=False, staging_copy=False)
