"""Pure layout rules (no processes): node grouping, hop composition, chunking."""
from __future__ import annotations

import random

import pytest
import torch

from megatron_sdp4bit.comm.layout import (
    MAX_CHUNK_ELEMENTS,
    MIN_CHUNK_SHARD_ELEMENTS,
    chunk_count,
    chunk_plan,
    plan_node_layout,
    two_level_send_order,
)


def test_nodes_are_built_from_the_groups_own_ranks():
    # Tensor parallelism 2 on 2 nodes of 4: DP group [1, 3, 5, 7] has 2 members per node.
    layout = plan_node_layout([7, 1, 5, 3], ranks_per_node=4)
    assert layout.nodes == ((1, 3), (5, 7))
    assert layout.is_two_level and layout.fallback_reason is None
    assert layout.intra_members() == [(1, 3), (5, 7)]
    assert layout.inter_members() == [(1, 5), (3, 7)]
    assert layout.same_node_peers(5) == 1


@pytest.mark.parametrize("ranks,rpn,sizes", [
    (range(6), 4, [4, 2]),     # DP size not a multiple of ranks per node
    ([0, 1, 2], 2, [2, 1]),    # nodes of unequal size
])
def test_uneven_spread_is_flagged_not_guessed(ranks, rpn, sizes):
    layout = plan_node_layout(list(ranks), rpn)
    assert not layout.is_two_level
    assert str(sizes) in layout.fallback_reason and "ranks_per_node" in layout.fallback_reason


def test_single_level_shapes():
    assert not plan_node_layout(range(4), 4).is_two_level  # one node
    assert not plan_node_layout([0, 4, 8], 4).is_two_level  # one member per node
    assert plan_node_layout([0, 4, 8], 4).fallback_reason is None


@pytest.mark.parametrize("ranks,rpn", [([], 2), ([0, 0], 2), ([-1, 0], 2), ([0, 1], 0)])
def test_bad_layout_arguments_raise(ranks, rpn):
    with pytest.raises(ValueError):
        plan_node_layout(ranks, rpn)


def _simulate_two_hops(dp_order, rpn, shard=3):
    """Run the reduce-scatter's data movement with plain tensors, as gradients.py does it.

    Each rank gathers its input's shards in send order, then two all-to-alls of
    equal chunks (intra group rank = local index, inter group rank = node index)
    each followed by a sum. Returns {global rank: received shard}, and the inputs.
    """
    layout = plan_node_layout(dp_order, rpn)
    order = torch.tensor(two_level_send_order(layout, dp_order))
    dp = len(dp_order)
    nodes, per_node = layout.num_nodes, layout.members_per_node
    inputs = {g: torch.randn(dp, shard, dtype=torch.float64) for g in dp_order}
    sends = {g: inputs[g][order] for g in dp_order}  # [dp, shard] in send order
    after_intra = {}
    for node in layout.nodes:
        for local, me in enumerate(node):  # block `local` of every node member, summed
            after_intra[me] = sum(sends[peer].view(per_node, nodes, shard)[local] for peer in node)
    final = {}
    for local, inter_group in enumerate(layout.inter_members()):
        for node_index, me in enumerate(inter_group):
            final[me] = sum(after_intra[peer][node_index] for peer in inter_group)
    return final, inputs


@pytest.mark.parametrize("world,rpn,stride,shuffle", [
    (4, 2, 1, False), (8, 2, 1, False), (8, 4, 1, False), (16, 4, 1, True),
    (16, 8, 2, False), (24, 6, 3, True), (32, 8, 2, True),
])
def test_two_hops_compose_to_a_plain_reduce_scatter(world, rpn, stride, shuffle):
    """Group rank r ends with shard r of the sum, for strided and reordered DP groups."""
    torch.manual_seed(world * 100 + rpn)
    dp_order = list(range(0, world, stride))
    if shuffle:  # a DP group whose rank order is not sorted global ranks
        random.Random(world).shuffle(dp_order)
    final, inputs = _simulate_two_hops(dp_order, rpn)
    total = sum(inputs.values())
    for position, g in enumerate(dp_order):
        assert torch.allclose(final[g], total[position]), f"rank {g} got the wrong shard"


@pytest.mark.parametrize("shard,align,max_chunks", [
    (1, 128, 4), (127, 128, 4), (128, 128, 4), (1000, 128, 4), (4096, 128, 4),
    (5 * 128 + 1, 128, 4), (3000, 256, 3), (10_000, 384, 7), (4096, 2048, 1),
])
def test_chunk_plan_covers_the_shard_with_aligned_chunks(shard, align, max_chunks):
    chunks = chunk_plan(shard, align, max_chunks)
    assert 1 <= len(chunks) <= max_chunks
    assert chunks[0].start == 0 and sum(c.valid for c in chunks) == shard
    for before, after in zip(chunks, chunks[1:]):
        assert after.start == before.start + before.valid == before.start + before.padded
    for c in chunks:
        assert c.padded % align == 0 and 0 < c.valid <= c.padded
    assert sum(c.padded for c in chunks) - shard < align  # padding stays below one unit


def test_chunk_plan_edge_cases():
    assert chunk_plan(0, 128, 4) == []
    with pytest.raises(ValueError):
        chunk_plan(10, 0, 4)


@pytest.mark.parametrize("shard,dp,chunks,cap,expected", [
    (1000, 4, 1, 1 << 24, 1),            # small bucket: the configured count
    (1000, 4, 3, 1 << 24, 3),
    (1 << 24, 8, 1, 1 << 24, 8),         # one chunk per 2^24 elements over all shards
    ((1 << 24) + 1, 8, 2, 1 << 24, 9),   # rounded up
    (100, 4, 1, 64, 7),
])
def test_chunk_count_caps_the_elements_of_a_chunk(shard, dp, chunks, cap, expected):
    count = chunk_count(shard, dp, chunks, cap, min_shard_elements=1)
    assert count == expected
    # What the cap promises: no chunk (over all shards) exceeds it unless alignment does.
    largest = max(c.valid for c in chunk_plan(shard, 1, count))
    assert largest * dp <= max(cap, dp) or count == chunks


def test_chunks_keep_a_useful_size_at_many_ranks():
    """At DP 128, 4 M elements over all shards is 32 K per shard: a 6.7B bucket would be
    1,600 chunks of two all-to-alls each. A chunk keeps 256 K elements of a shard."""
    shard = 52_000_000  # a 6.7B model's shard at DP 128, one bucket
    assert chunk_count(shard, 128, 1, MAX_CHUNK_ELEMENTS) == -(-shard // MIN_CHUNK_SHARD_ELEMENTS)
    assert chunk_count(shard, 8, 1, MAX_CHUNK_ELEMENTS) == -(-shard * 8 // MAX_CHUNK_ELEMENTS)
    assert chunk_count(1000, 128, 3, MAX_CHUNK_ELEMENTS) == 3  # pipeline_chunks still rules


def test_chunk_count_rejects_non_positive_sizes():
    with pytest.raises(ValueError):
        chunk_count(10, 0, 1, 64)
    with pytest.raises(ValueError):
        chunk_count(10, 4, 1, 0)
