"""comm/memory.py: what the layer adds in memory, as arithmetic over bucket sizes.

That the held bytes equal what the installed layer really keeps is checked on
real ranks in tests/megatron/test_patch.py; here, the rules the figures follow.
"""
from __future__ import annotations

import pytest

from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS, chunk_count
from megatron_sdp4bit.comm.memory import (
    grad_scatter_scratch,
    held_bytes,
    layer_memory,
    quantized_nbytes,
    weight_gather_scratch,
)
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


def test_weight_gather_scratch_is_every_ranks_codes():
    dp, shard = 8, 4096
    assert weight_gather_scratch(dp * shard, dp, SDP) == (dp + 1) * quantized_nbytes(shard, 4, 2048)
    assert weight_gather_scratch(dp * shard, dp, preset("tlq-hs-only")) == 0  # megatron's own


@pytest.mark.parametrize("overlapped", [False, True])
def test_reduce_scatter_scratch_does_not_grow_with_the_bucket(overlapped):
    """Without --overlap-grad-reduce megatron makes one bucket of everything, with it
    buckets of 40M elements or more; chunks launched one after another keep the
    scratch at a few chunks' worth however large the bucket is."""
    dp = 8
    small = grad_scatter_scratch(dp * MAX_CHUNK_ELEMENTS, dp, SDP, 4, 4, overlapped)
    large = grad_scatter_scratch(dp * 50 * MAX_CHUNK_ELEMENTS, dp, SDP, 4, 4, overlapped)
    assert large == small
    # ... and is a few bytes per element of one chunk: 2 x (8-bit codes sent and received)
    # for two chunks (three overlapped), a 4-byte staging copy of one, the small second hop
    # and the output.
    low, high = (8, 12) if overlapped else (6, 10)
    assert low * MAX_CHUNK_ELEMENTS < small < high * MAX_CHUNK_ELEMENTS


def test_overlap_adds_the_next_buckets_first_chunk():
    dp, shard = 8, 1 << 20
    sync = grad_scatter_scratch(dp * shard, dp, SDP, 4, 4, overlapped=False)
    overlapped = grad_scatter_scratch(dp * shard, dp, SDP, 4, 4, overlapped=True)
    chunk = dp * shard // chunk_count(shard, dp, SDP.pipeline_chunks, MAX_CHUNK_ELEMENTS)
    assert overlapped - sync == 2 * quantized_nbytes(chunk, 8, 128)
    assert grad_scatter_scratch(dp * shard, dp, preset("qwd-only"), 4, 4, True) == 0


def test_one_level_has_no_second_hop_and_ulq_uses_the_low_width():
    dp, shard = 4, 1 << 16
    one_level = grad_scatter_scratch(dp * shard, dp, SDP, 0, 4, overlapped=True)
    two_level = grad_scatter_scratch(dp * shard, dp, SDP, 2, 4, overlapped=True)
    assert one_level < two_level
    ulq = grad_scatter_scratch(dp * shard, dp, preset("zeropp"), 2, 4, overlapped=True)
    assert ulq < two_level  # 4-bit codes on the first hop instead of 8


def test_layer_memory_peak_is_the_larger_phase():
    dp, n = 8, 8 * (1 << 20)
    kwargs = dict(params=3 * n, node_members=4, fp32_params=False)
    one = layer_memory([n, n, n], dp, SDP, **kwargs)
    assert one.held_bytes == 3 * 4 * n // dp
    assert one.scratch_bytes == grad_scatter_scratch(n, dp, SDP, 4, 4, overlapped=False)
    both = layer_memory([n, n, n], dp, SDP, overlap_grad_reduce=True, overlap_param_gather=True,
                        **kwargs)
    assert both.scratch_bytes == max(grad_scatter_scratch(n, dp, SDP, 4, 4, overlapped=True),
                                     2 * weight_gather_scratch(n, dp, SDP, whole_bucket=True))
    assert layer_memory([n], dp, preset("baseline"), **kwargs).total_bytes == 0
    assert "B/param" in one.describe() and one.per_param(one.held_bytes) == pytest.approx(4 / dp)


def test_sync_weight_gather_works_in_slices():
    dp = 8
    huge = dp * 100 * MAX_CHUNK_ELEMENTS
    sliced = weight_gather_scratch(huge, dp, SDP, whole_bucket=False)
    assert sliced == weight_gather_scratch(dp * 10 * MAX_CHUNK_ELEMENTS, dp, SDP, whole_bucket=False)
    # two slices of every rank's 4-bit codes (and its own again) and their scales
    assert sliced < 1.2 * MAX_CHUNK_ELEMENTS
    small = dp * 4096
    assert weight_gather_scratch(small, dp, SDP, False) == weight_gather_scratch(small, dp, SDP, True)
