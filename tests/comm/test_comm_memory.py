"""comm/memory_plan.py: what the layer adds in memory, as arithmetic over bucket sizes.

That the held bytes and the reused buffers equal what the installed layer really
keeps is checked on real ranks in tests/megatron/test_patch.py; here, the rules the
figures follow.
"""
from __future__ import annotations

import pytest

from megatron_sdp4bit.comm.layout import (MAX_CHUNK_ELEMENTS, MIN_SLICE_ELEMENTS, ONE_QUEUE_WHOLE_BUCKET_ELEMENTS,
                                          weight_slices)
from megatron_sdp4bit.comm.memory_plan import (
    grad_buffer_demand,
    held_bytes,
    layer_memory,
    quantized_nbytes,
    weight_buffer_demand,
    weight_gather_scratch,
)
from megatron_sdp4bit.quant import segment_nbytes
from megatron_sdp4bit.config import preset

SDP = preset("sdp4bit")


def test_quantized_bytes_are_codes_plus_one_fp32_scale_per_group():
    assert quantized_nbytes(2048, 4, 2048) == 1024 + 4
    assert quantized_nbytes(2049, 4, 2048) == 2048 + 8  # the last group is padded
    assert quantized_nbytes(256, 8, 128) == 256 + 8


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_held_is_one_fp32_main_shard_per_bucket(dp):
    buckets = [dp * 1000, dp * 300]
    assert held_bytes(buckets, dp, SDP, fp32_params=False) == 4 * 1300
    assert held_bytes(buckets, dp, SDP, fp32_params=True) == 8 * 1300  # + set-aside weights
    assert held_bytes(buckets, dp, preset("tlq-hs-only"), fp32_params=False) == 0
    assert held_bytes(buckets, 1, SDP, fp32_params=False) == 0


def test_weight_buffers_are_this_ranks_segment_and_every_ranks():
    dp, shard = 8, 4096
    own = segment_nbytes(shard, 4, 2048)
    # one slice, in either slot: a call starts on the slot after the previous call's last
    assert weight_buffer_demand(dp * shard, dp, SDP) == {
        "weights send 0": own, "weights gather 0": dp * own,
        "weights send 1": own, "weights gather 1": dp * own}
    assert own == quantized_nbytes(shard, 4, 2048) + 8  # scales 16-byte aligned: 2 + 6 pad bytes
    assert weight_buffer_demand(dp * shard, dp, preset("tlq-hs-only")) == {}  # megatron's own
    assert weight_gather_scratch(dp * shard, dp, SDP) == 0  # qWD adds in place
    assert weight_gather_scratch(dp * shard, dp, preset("zeropp")) == 4 * dp * shard  # qW's values


def test_two_level_weight_gathers_add_only_the_reordered_segments():
    """2 nodes x 4 ranks (comm/gather_hops.py): besides its segment and every rank's, a
    slot holds every rank's again, before the copy into DP order (the hop across nodes
    writes into it, no buffer of its own); one node, or one rank a node, keeps the flat
    gather's."""
    dp, shard = 8, 4096
    own = segment_nbytes(shard, 4, 2048)
    two_levels = weight_buffer_demand(dp * shard, dp, SDP, node_members=4)
    assert two_levels == {**weight_buffer_demand(dp * shard, dp, SDP),
                          **{f"weights by local rank {slot}": dp * own for slot in (0, 1)}}
    for flat in (0, 1, dp):
        assert weight_buffer_demand(dp * shard, dp, SDP, flat) == weight_buffer_demand(dp * shard, dp, SDP)
    flat_gather = preset("sdp4bit", weight_gather="flat")
    assert weight_buffer_demand(dp * shard, dp, flat_gather, 4) == weight_buffer_demand(dp * shard, dp, SDP)


def test_reduce_scatter_buffers_do_not_grow_with_the_bucket():
    """Without --overlap-grad-reduce megatron makes one bucket of everything, with it
    buckets of 40M elements or more; chunks taking turns on two slots keep the buffers
    at two chunks' worth however large the bucket is."""
    dp = 8
    small = grad_buffer_demand(dp * 2 * MAX_CHUNK_ELEMENTS, dp, SDP, 4)
    large = grad_buffer_demand(dp * 50 * MAX_CHUNK_ELEMENTS, dp, SDP, 4)
    assert large == small
    assert sorted(small) == [f"grads hop {h} {k} {s}" for h in (0, 1)
                             for k in ("receive", "send") for s in (0, 1)]
    # ... a chunk's 8-bit codes sent and received, in two slots, and the small second hop
    assert 4 * MAX_CHUNK_ELEMENTS < sum(small.values()) < 5 * MAX_CHUNK_ELEMENTS
    # a bucket of one chunk uses one slot
    assert set(grad_buffer_demand(dp * 4096, dp, SDP, 4)) == {
        "grads hop 0 send 0", "grads hop 0 receive 0", "grads hop 1 send 0", "grads hop 1 receive 0"}


def test_one_level_has_no_second_hop_and_ulq_uses_the_low_width():
    dp, shard = 4, 1 << 16
    one_node = grad_buffer_demand(dp * shard, dp, SDP, dp)
    one_per_node = grad_buffer_demand(dp * shard, dp, SDP, 1)
    two_level = grad_buffer_demand(dp * shard, dp, SDP, 2)
    assert set(one_node) == set(one_per_node) == {"grads hop 0 send 0", "grads hop 0 receive 0"}
    assert sum(one_per_node.values()) < sum(one_node.values())  # 4-bit inter-node vs 8-bit
    assert sum(one_node.values()) < sum(two_level.values())
    ulq = grad_buffer_demand(dp * shard, dp, preset("zeropp"), 2)
    assert sum(ulq.values()) < sum(two_level.values())  # 4-bit codes on the first hop instead of 8
    assert grad_buffer_demand(dp * shard, dp, preset("qwd-only"), 2) == {}


def test_an_unaligned_shard_adds_one_fp32_sum_of_its_last_chunk():
    dp = 4
    assert "grads sum" not in grad_buffer_demand(dp * 4096, dp, SDP, 2)
    assert grad_buffer_demand(dp * 4100, dp, SDP, 2)["grads sum"] == 4 * 128 * 33  # padded


def test_layer_memory_shares_buffers_because_one_collective_runs_at_a_time():
    """The layer's runner (comm/runner.py) runs its collectives one after another, also
    when they overlap the backward and forward passes: one set of buffers per direction."""
    dp, n = 8, 8 * (1 << 20)
    kwargs = dict(params=3 * n, node_members=4, fp32_params=False)
    one = layer_memory([n, n, n], dp, SDP, **kwargs)
    assert one.held_bytes == 3 * 4 * n // dp
    grads = sum(grad_buffer_demand(n, dp, SDP, 4).values())
    sliced = sum(weight_buffer_demand(n, dp, SDP, 4).values())
    assert one.buffer_bytes == grads + sliced  # one set for every bucket
    assert one.scratch_bytes == 0  # qWD adds in place
    assert layer_memory([n], dp, preset("zeropp"), **kwargs).scratch_bytes == \
        weight_gather_scratch(n, dp, preset("zeropp"))
    assert layer_memory([n], dp, preset("baseline"), **kwargs).total_bytes == 0
    assert "B/param" in one.describe() and one.per_param(one.held_bytes) == pytest.approx(4 / dp)


def test_a_two_slice_buckets_full_slice_may_land_in_either_slot():
    """A gather's slices take the slots after the previous gather's last, which depends on
    the buckets before it: a [full, smaller] bucket may start on slot 1, so both slots must
    hold a full slice (the plan sized slot 1 for the smaller one: 2.4 MB short at DP 8)."""
    dp, shard = 8, 1_500_000
    slices = weight_slices(shard, dp, 2048, False, MAX_CHUNK_ELEMENTS)
    assert len(slices) == 2 and slices[0][1] > slices[1][1]
    full = segment_nbytes(slices[0][1], 4, 2048)
    demand = weight_buffer_demand(dp * shard, dp, SDP)
    for slot in (0, 1):
        assert demand[f"weights send {slot}"] == full
        assert demand[f"weights gather {slot}"] == dp * full


def test_sync_weight_gather_works_in_slices():
    dp = 8
    huge = dp * 100 * MAX_CHUNK_ELEMENTS
    sliced = weight_buffer_demand(huge, dp, SDP)
    assert sliced == weight_buffer_demand(dp * 10 * MAX_CHUNK_ELEMENTS, dp, SDP)
    # two slots of every rank's 4-bit codes (and its own again) and their scales, slices
    # of MAX_CHUNK_ELEMENTS over all ranks but at least MIN_SLICE_ELEMENTS per rank
    per_rank = max(MAX_CHUNK_ELEMENTS // dp, MIN_SLICE_ELEMENTS)
    assert sum(sliced.values()) == 2 * (dp + 1) * segment_nbytes(per_rank, 4, 2048)
    small = dp * 4096
    assert set(weight_buffer_demand(small, dp, SDP)) == {
        f"weights {kind} {slot}" for kind in ("send", "gather") for slot in (0, 1)}


def test_synchronous_gathers_keep_useful_calls_at_many_ranks():
    """Slices of MAX_CHUNK_ELEMENTS over all ranks would be 32 K elements per rank at DP
    128 (300 all-gather calls for a 1.3B shard, each paying a 128-rank ring's latency);
    a slice keeps at least MIN_SLICE_ELEMENTS per rank, in whole groups."""
    shard = 10_300_000  # a 1.3B model's shard at DP 128
    slices = weight_slices(shard, 128, 2048, False, MAX_CHUNK_ELEMENTS)
    assert len(slices) == 10 and all(n >= MIN_SLICE_ELEMENTS for _, n in slices[:-1])
    assert all(start % 2048 == 0 for start, _ in slices) and sum(n for _, n in slices) == shard
    # at DP 8 the cap over all ranks is the floor: 1M elements a rank, 10 slices
    assert MAX_CHUNK_ELEMENTS // 8 == MIN_SLICE_ELEMENTS
    assert len(weight_slices(shard, 8, 2048, False, MAX_CHUNK_ELEMENTS)) == 10
    assert weight_slices(shard, 128, 2048, True, MAX_CHUNK_ELEMENTS) == [(0, shard)]


@pytest.mark.parametrize("dp, node_members, one_queue_mib, default_mib",
                         [(8, 8, 122, 41), (16, 8, 163, 67)])
def test_one_hardware_queue_takes_megatrons_buckets_whole(dp, node_members, one_queue_mib,
                                                          default_mib):
    """Up to the deferring runner's limit (``ONE_QUEUE_WHOLE_BUCKET_ELEMENTS``) a bucket
    is one chunk and one slice: for megatron's default overlapped bucket (40 M elements,
    padded) the buffers are the bucket's, a few bytes per element (the figures
    comm/layout.py quotes), not two chunks' of ``MAX_CHUNK_ELEMENTS``. Above it (a whole
    pipeline stage in one bucket) the chunks and the buffers are the other runners'."""
    n = -(-40_000_000 // (dp * 128)) * dp * 128
    shard = n // dp

    def mib(bucket, whole):
        grads = grad_buffer_demand(bucket, dp, SDP, node_members, whole)
        weights = weight_buffer_demand(bucket, dp, SDP, node_members, whole)
        return (sum(grads.values()) + sum(weights.values())) / 2**20

    one_queue = ONE_QUEUE_WHOLE_BUCKET_ELEMENTS
    assert set(grad_buffer_demand(n, dp, SDP, node_members, one_queue)) <= {
        f"grads hop {h} {k} 0" for h in (0, 1) for k in ("send", "receive")}  # one chunk
    assert round(mib(n, one_queue)) == one_queue_mib
    assert round(mib(n, None)) == default_mib
    assert layer_memory([n], dp, SDP, params=n, node_members=node_members, fp32_params=False,
                        whole_bucket_elements=one_queue).buffer_bytes == round(mib(n, one_queue) * 2**20)
    # a stage of 500 M parameters in one bucket: chunks of MAX_CHUNK_ELEMENTS, as elsewhere
    stage = -(-500_000_000 // (dp * 128)) * dp * 128
    assert grad_buffer_demand(stage, dp, SDP, node_members, one_queue) == \
        grad_buffer_demand(stage, dp, SDP, node_members, None)
    assert weight_buffer_demand(stage, dp, SDP, node_members, one_queue) == \
        weight_buffer_demand(stage, dp, SDP, node_members, None)
    # with both, a workspace keeps the larger of each buffer: the whole bucket's at most
    both = layer_memory([n, stage], dp, SDP, params=n + stage, node_members=node_members,
                        fp32_params=False, whole_bucket_elements=one_queue).buffer_bytes
    assert mib(n, one_queue) * 2**20 <= both <= (mib(n, one_queue) + mib(stage, None)) * 2**20
