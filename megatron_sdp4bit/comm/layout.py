"""Pure arithmetic of the collectives: node layout, buffer order, chunking.

Nothing here touches torch.distributed, so every rule can be unit-tested in one
process (including layouts of world sizes no test machine can spawn).

Vocabulary: a *DP group* is a list of global ranks. A *node* is a set of ranks
that share a fast link; the node of global rank g is ``g // ranks_per_node``
(the ranks each host holds, ``comm/host_layout.py``). A DP group whose members spread
evenly over its nodes (``L`` members on each of ``N`` nodes) gets a two-level
reduce-scatter: an all-to-all among the ``L`` members of a node, then one among
the ``N`` members that hold the same local index on every node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class NodeLayout:
    """How one DP group's members spread over physical nodes.

    ``nodes`` lists each node's members (sorted global ranks), nodes in
    increasing node id. ``fallback_reason`` is set when the nodes are not all
    the same size: the collectives then use one flat level.
    """

    ranks: tuple[int, ...]
    physical_ranks_per_node: int
    nodes: tuple[tuple[int, ...], ...]
    fallback_reason: Optional[str] = None

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def members_per_node(self) -> int:
        """DP members on each node (meaningful only without a fallback)."""
        return len(self.nodes[0])

    @property
    def is_two_level(self) -> bool:
        return (self.fallback_reason is None and self.num_nodes > 1
                and self.members_per_node > 1)

    def node_of(self, global_rank: int) -> int:
        """Index (into ``nodes``) of the node holding ``global_rank``."""
        for index, members in enumerate(self.nodes):
            if global_rank in members:
                return index
        raise ValueError(f"rank {global_rank} is not in the DP group {list(self.ranks)}")

    def same_node_peers(self, global_rank: int) -> int:
        """Other DP members on ``global_rank``'s physical node."""
        return len(self.nodes[self.node_of(global_rank)]) - 1

    def intra_members(self) -> list[tuple[int, ...]]:
        """Members of each intra-node group (one per node), for a two-level layout."""
        return list(self.nodes)

    def inter_members(self) -> list[tuple[int, ...]]:
        """Members of each inter-node group (one per local index), sorted by node."""
        return [tuple(node[local] for node in self.nodes)
                for local in range(self.members_per_node)]


def plan_node_layout(ranks: Sequence[int], ranks_per_node: int) -> NodeLayout:
    """Group a DP group's global ranks by node; flag uneven spreads.

    ``ranks`` may be in any order and need not be contiguous (tensor and
    pipeline parallelism interleave DP groups): only membership matters here.
    """
    if not isinstance(ranks_per_node, int) or ranks_per_node <= 0:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} must be a positive integer")
    members = [int(r) for r in ranks]
    if not members:
        raise ValueError("the DP group has no ranks")
    if len(set(members)) != len(members) or min(members) < 0:
        raise ValueError(f"DP group ranks {members} must be distinct non-negative integers")
    by_node: dict[int, list[int]] = {}
    for rank in sorted(members):
        by_node.setdefault(rank // ranks_per_node, []).append(rank)
    nodes = tuple(tuple(by_node[node]) for node in sorted(by_node))
    sizes = [len(node) for node in nodes]
    reason = None
    if len(set(sizes)) > 1:
        reason = (
            f"DP group {sorted(members)} spreads unevenly over nodes of "
            f"{ranks_per_node} ranks (DP members per node: {sizes}); a two-level "
            "collective needs the same number on every node. Make the DP size a "
            "multiple of ranks_per_node, or set ranks_per_node to match the machines"
        )
    return NodeLayout(tuple(members), ranks_per_node, nodes, reason)


def two_level_send_order(layout: NodeLayout,
                         dp_ranks_in_group_order: Sequence[int]) -> tuple[int, ...]:
    """Which DP shard fills each slot of the first hop's send buffer.

    The buffer holds ``L`` blocks (one per intra-node peer j, in intra-group
    order = local index); block j holds the shards of the ``N`` members of
    peer j's inter-node group, in node order. After the intra-node all-to-all,
    local rank j holds its node's partial sums of exactly those shards, in the
    order its inter-node all-to-all sends them: node k gets the shard of its
    own member. The two hops therefore compose to a plain reduce-scatter.
    Returns DP group ranks (positions in ``dp_ranks_in_group_order``).
    """
    position = {g: i for i, g in enumerate(dp_ranks_in_group_order)}
    return tuple(position[node[local]]
                 for local in range(layout.members_per_node)
                 for node in layout.nodes)


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk: shard elements ``[start, start + valid)`` padded to ``padded``."""

    start: int
    valid: int
    padded: int


def chunk_plan(shard_numel: int, align: int, max_chunks: int) -> list[Chunk]:
    """Split a shard into at most ``max_chunks`` chunks whose lengths are multiples of ``align``.

    Every chunk but the last is full; the last is zero-padded by fewer than
    ``align`` elements, so the whole shard carries less than ``align`` of
    padding. Fewer chunks are used when the shard is too short to fill them.
    """
    if shard_numel <= 0:
        return []
    if align <= 0 or max_chunks <= 0:
        raise ValueError(f"align={align} and max_chunks={max_chunks} must be positive")
    units = -(-shard_numel // align)
    units_per_chunk = -(-units // min(max_chunks, units))
    chunks = []
    for first_unit in range(0, units, units_per_chunk):
        start = first_unit * align
        padded = min(units_per_chunk, units - first_unit) * align
        chunks.append(Chunk(start, min(padded, shard_numel - start), padded))
    return chunks


MAX_CHUNK_ELEMENTS = 1 << 23
"""At most this many elements (over all DP shards) per pipeline chunk. Without
--overlap-grad-reduce megatron puts every parameter in one bucket; chunks of at
most 8M elements keep the reduce-scatter's buffers near 45 MiB (two slots of a
chunk's 8-bit codes sent and received, comm/memory_plan.py): the layer stays under 1
byte per parameter at DP 8 even for a 125M model (16M elements would take it to
1.3). Each chunk costs the host two seed draws, three launches and two collective
calls (scripts/count_chunk_work.py), so the cap also sets the chunks per step:
megatron's 40M-element buckets are 5 chunks each (4M elements made them 10;
docs/performance.md, "Host work per chunk")."""


ONE_QUEUE_WHOLE_BUCKET_ELEMENTS = 1 << 26
"""On the runner for one hardware queue (``comm/deferring_runner.py``) a collective of
at most this many elements (over all DP shards) runs as one chunk, one weight slice
(``whole_bucket``). There a wait for a hop still in flight holds up every kernel queued
after it, so a stage is issued only at megatron's next call, and a bucket's chunks
would wait for one another's hops inside one call, in front of the pass's kernels.
64 M elements takes megatron's overlapped buckets whole (40 M elements, or 1 M x DP
from DP 40 on; a bucket closes after the parameter that crosses the size, so some are
larger), for buffers of about 2.2 bytes per element of the largest such bucket for
the gradients and 1.1-2.1 for the weights' two slots (comm/memory_plan.py): 122 MiB
for 40 M-element buckets at DP 8 on one node, 163 MiB at DP 16 on two, against 41 and
67 MiB in chunks of ``MAX_CHUNK_ELEMENTS`` (tests/comm/test_comm_memory.py). A larger
bucket (megatron makes one of a whole pipeline stage after the first) keeps chunks
of ``MAX_CHUNK_ELEMENTS``: its chunks would wait in one call at either size, and its
buffers stay two chunks'."""


def whole_bucket(elements: int, whole_bucket_elements: Optional[int]) -> bool:
    """Whether a collective over ``elements`` elements (all DP shards) runs as one chunk
    and one slice: at most ``whole_bucket_elements``, a runner's limit (None: never;
    ``comm/runner.py``)."""
    return whole_bucket_elements is not None and elements <= whole_bucket_elements


MIN_CHUNK_SHARD_ELEMENTS = 1 << 18
"""A reduce-scatter chunk holds at least this many elements of each shard (unless
``pipeline_chunks`` asks for more chunks): each chunk is two all-to-all calls whose
latency grows with the peers, and at DP 128 chunks of ``MAX_CHUNK_ELEMENTS`` over all
shards would be 32 K elements per shard, 1,600 calls for a 6.7B bucket (sdp4bit-estimate:
0.18 s of gradient communication per step on H800 x 128, 0.07 s with this floor). 256 K
elements per shard is 128 KiB of 4-bit codes per peer of the inter-node hop; the buffers
grow with DP only from DP 16 on (where 4 M elements over all shards is less)."""


def chunk_count(shard_numel: int, dp_size: int, pipeline_chunks: int, max_chunk_elements: int,
                min_shard_elements: int = MIN_CHUNK_SHARD_ELEMENTS) -> int:
    """How many pipeline chunks a reduce-scatter of ``dp_size`` shards uses: the
    configured ``pipeline_chunks``, or more where a chunk (over all shards) would
    exceed ``max_chunk_elements``, so that its buffers do not grow with the bucket, but
    not so many that a chunk holds fewer than ``min_shard_elements`` of a shard."""
    if min(dp_size, pipeline_chunks, max_chunk_elements, min_shard_elements) <= 0:
        raise ValueError(f"dp_size={dp_size}, pipeline_chunks={pipeline_chunks}, "
                         f"max_chunk_elements={max_chunk_elements} and min_shard_elements="
                         f"{min_shard_elements} must be positive")
    by_size = -(-shard_numel * dp_size // max_chunk_elements)
    by_floor = max(1, -(-shard_numel // min_shard_elements))
    return max(pipeline_chunks, min(by_size, by_floor))


def lcm(*values: int) -> int:
    return math.lcm(*values) if values else 1


MIN_SLICE_ELEMENTS = 1 << 20
"""A synchronous weight gather's slice holds at least this many elements per rank: each
slice is one all-gather call, whose latency grows with the ranks (a ring pays a hop per
rank; NCCL's own model prices a 128-rank ring at about 0.6 ms), so slices of
``MAX_CHUNK_ELEMENTS`` over all ranks, 32 K elements each at DP 128, made a 1.3B model's
gather 300 calls and 0.2 s (sdp4bit-estimate, H800 x 128). 1 M elements is 0.5 MiB of
4-bit codes per rank and call; the gather buffer is DP times that (64 MiB at DP 128)."""


def weight_slices(shard: int, dp: int, group_size: int, whole: bool,
                  max_chunk_elements: int,
                  min_slice_elements: int = MIN_SLICE_ELEMENTS) -> list[tuple[int, int]]:
    """``(start, elements)`` of each slice a weight all-gather of ``shard``-element shards
    runs in: the whole shard at once (``whole``: an overlapped gather, in flight while the
    caller goes on), or whole groups of at most ``max_chunk_elements`` over all ``dp``
    ranks but at least ``min_slice_elements`` per rank (a synchronous one: a few slices'
    codes alive at a time, not the bucket's, in calls of a useful size)."""
    if shard <= 0:
        return []
    if whole:
        return [(0, shard)]
    groups = max(1, max_chunk_elements // (dp * group_size), min_slice_elements // group_size)
    step = min(shard, groups * group_size)
    return [(start, min(step, shard - start)) for start in range(0, shard, step)]
