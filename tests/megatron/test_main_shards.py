"""The exact fp32 main shards' keys in a saved layer state, and whether saved ones fit.

Checked on a stand-in of the adapter (megatron's chain of distributed optimizers as
lists of buckets): keys name the sub-optimizer, so a dense and an expert optimizer's
buckets no longer share keys; a checkpoint of an older release (keys without the
sub-optimizer, the chain's later optimizer replacing the earlier one's shards) is read
as that save wrote it, every shard going to the bucket it came from; a shard that does
not fit this rank's bucket is refused in one line naming the bucket.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sdp4bit.megatron.main_shards import fp32_buckets, misfit, under_current_keys


class _Optimizer:
    def __init__(self, buckets, rank=1, size=2):
        self.buckets = [torch.zeros(numel, dtype=dtype) for dtype, numel in buckets]
        self.rank, self.size = rank, size


class _Adapter:
    """What ``main_shards`` asks of megatron-core's adapter, for a chain of optimizers
    that each hold one buffer of buckets."""

    def sub_optimizers(self, chain):
        return chain

    def buffer_buckets(self, opt):
        return [((0, k), bucket) for k, bucket in enumerate(opt.buckets)]

    def bucket_param_data(self, bucket):
        return bucket

    def optimizer_group(self, opt):
        return opt.rank, opt.size

    def param_shard(self, bucket, size, rank):
        shard = bucket.numel() // size
        return bucket[rank * shard:(rank + 1) * shard]


def _moe_chain(expert_dp=2):
    """A dense optimizer (data-parallel 2) with 3 fp32 buckets and a bf16 one, and an
    expert optimizer with 2 fp32 buckets and a data-parallel group of its own."""
    dense = _Optimizer([(torch.float32, 40), (torch.float32, 24), (torch.bfloat16, 8), (torch.float32, 16)])
    experts = _Optimizer([(torch.float32, 24), (torch.float32, 80)], rank=0, size=expert_dp)
    return [dense, experts]


def test_each_fp32_bucket_of_the_chain_has_its_own_key_shard_size_and_group_size():
    assert fp32_buckets(_Adapter(), _moe_chain()) == {
        (0, 0, 0): (20, 2), (0, 0, 1): (12, 2), (0, 0, 3): (8, 2), (1, 0, 0): (12, 2), (1, 0, 1): (40, 2)}
    assert fp32_buckets(_Adapter(), [_Optimizer([(torch.bfloat16, 8)])]) == {}


def _older_save(buckets: dict) -> tuple:
    """(what releases before the sub-optimizer key saved, each bucket's true shard): the
    chain's buckets in order, a shard for each bucket whose weights were gathered
    (data-parallel size above 1), each under (buffer, bucket), so a later optimizer's
    shard replaced an earlier one's."""
    true = {key: torch.full((size,), float(i)) for i, (key, (size, group)) in enumerate(buckets.items())
            if group > 1}
    saved = {}
    for key, shard in true.items():
        saved[key[1:]] = shard
    return saved, true


def test_an_older_save_is_read_as_it_was_written():
    """Every shard the older save kept goes back to the bucket it came from; the buckets
    whose shard it replaced are named, and get none (they continue from megatron's
    saved weights)."""
    buckets = fp32_buckets(_Adapter(), _moe_chain())
    saved, true = _older_save(buckets)
    shards, replaced = under_current_keys(saved, buckets)
    assert set(shards) == {(1, 0, 0), (1, 0, 1), (0, 0, 3)}
    for key, shard in shards.items():
        assert torch.equal(shard, true[key]), key
    assert replaced == [(0, 0, 0), (0, 0, 1)]
    assert misfit(shards, buckets) is None


def test_an_older_save_whose_experts_were_not_gathered_kept_every_dense_shard():
    """Expert data-parallel size 1 (EP = DP): the expert weights were never quantized, so
    the older save held no expert shard, and every shard it holds is a dense bucket's."""
    buckets = fp32_buckets(_Adapter(), _moe_chain(expert_dp=1))
    saved, true = _older_save(buckets)
    shards, replaced = under_current_keys(saved, buckets)
    assert replaced == [] and set(shards) == set(true) == {(0, 0, 0), (0, 0, 1), (0, 0, 3)}
    assert all(torch.equal(shards[key], true[key]) for key in true)
    assert misfit(shards, buckets) is None


def test_an_older_save_of_one_optimizer_loses_nothing():
    buckets = fp32_buckets(_Adapter(), [_moe_chain()[0]])
    saved, true = _older_save(buckets)
    shards, replaced = under_current_keys(saved, buckets)
    assert replaced == [] and set(shards) == set(true)
    assert all(torch.equal(shards[key], true[key]) for key in true)


def test_this_releases_keys_are_taken_as_they_are():
    buckets = fp32_buckets(_Adapter(), _moe_chain())
    saved = {key: torch.zeros(size) for key, (size, _) in buckets.items()}
    assert under_current_keys(saved, buckets) == (saved, [])
    assert under_current_keys({}, buckets) == ({}, [])


@pytest.mark.parametrize("key, numel, says", [
    ((0, 0, 1), 10, "has 10 elements, this rank's shard of that bucket is one of 12 elements here"),
    ((1, 0, 2), 4, "which this run does not have"),
])
def test_a_shard_that_does_not_fit_its_bucket_is_refused_naming_it(key, numel, says):
    buckets = fp32_buckets(_Adapter(), _moe_chain())
    shards = {k: torch.zeros(size) for k, (size, _) in buckets.items()}
    shards[key] = torch.zeros(numel)
    line = misfit(shards, buckets)
    assert line is not None and "\n" not in line
    assert f"bucket {key[2]} of buffer {key[1]} of optimizer {key[0]}" in line and says in line
    assert "--ddp-bucket-size" in line


def test_a_bucket_without_a_saved_shard_fits():
    """Its weights were not quantized (data-parallel size 1, or no qWD): megatron's
    saved weights are the exact ones."""
    assert misfit({(0, 0, 0): torch.zeros(20)}, fp32_buckets(_Adapter(), _moe_chain())) is None
