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

from megatron_sdp4bit.megatron.main_shards import fp32_shard_sizes, misfit, under_current_keys


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


def _moe_chain():
    """A dense optimizer with 3 fp32 buckets and a bf16 one, and an expert optimizer
    with 2 fp32 buckets (its own data-parallel size)."""
    dense = _Optimizer([(torch.float32, 40), (torch.float32, 24), (torch.bfloat16, 8), (torch.float32, 16)])
    experts = _Optimizer([(torch.float32, 12), (torch.float32, 40)], rank=0, size=1)
    return [dense, experts]


def test_each_fp32_bucket_of_the_chain_has_its_own_key_and_shard_size():
    sizes = fp32_shard_sizes(_Adapter(), _moe_chain())
    assert sizes == {(0, 0, 0): 20, (0, 0, 1): 12, (0, 0, 3): 8, (1, 0, 0): 12, (1, 0, 1): 40}
    assert fp32_shard_sizes(_Adapter(), [_Optimizer([(torch.bfloat16, 8)])]) == {}


def _older_save(chain_shards: dict) -> dict:
    """What releases before the sub-optimizer key saved: the chain's buckets in order,
    each under (buffer, bucket), so a later optimizer's shard replaced an earlier one's."""
    saved = {}
    for key, shard in chain_shards.items():
        saved[key[1:]] = shard
    return saved


def test_an_older_save_is_read_as_it_was_written():
    """Every shard the older save kept goes back to the bucket it came from; the buckets
    whose shard it replaced are named, and get none (they continue from megatron's
    saved weights)."""
    sizes = fp32_shard_sizes(_Adapter(), _moe_chain())
    true = {key: torch.full((size,), float(i)) for i, (key, size) in enumerate(sizes.items())}
    shards, replaced = under_current_keys(_older_save(true), list(sizes))
    assert set(shards) == {(1, 0, 0), (1, 0, 1), (0, 0, 3)}
    for key, shard in shards.items():
        assert torch.equal(shard, true[key]), key
    assert replaced == [(0, 0, 0), (0, 0, 1)]
    assert misfit(shards, sizes) is None


def test_an_older_save_of_one_optimizer_loses_nothing():
    chain = [_moe_chain()[0]]
    sizes = fp32_shard_sizes(_Adapter(), chain)
    true = {key: torch.full((size,), float(i)) for i, (key, size) in enumerate(sizes.items())}
    shards, replaced = under_current_keys(_older_save(true), list(sizes))
    assert replaced == [] and set(shards) == set(true)
    assert all(torch.equal(shards[key], true[key]) for key in true)


def test_this_releases_keys_are_taken_as_they_are():
    sizes = fp32_shard_sizes(_Adapter(), _moe_chain())
    saved = {key: torch.zeros(size) for key, size in sizes.items()}
    assert under_current_keys(saved, list(sizes)) == (saved, [])
    assert under_current_keys({}, list(sizes)) == ({}, [])


@pytest.mark.parametrize("key, numel, says", [
    ((0, 0, 1), 10, "has 10 elements, this rank's shard of that bucket is one of 12 elements here"),
    ((1, 0, 2), 4, "which this run does not have"),
])
def test_a_shard_that_does_not_fit_its_bucket_is_refused_naming_it(key, numel, says):
    sizes = fp32_shard_sizes(_Adapter(), _moe_chain())
    shards = {k: torch.zeros(size) for k, size in sizes.items()}
    shards[key] = torch.zeros(numel)
    line = misfit(shards, sizes)
    assert line is not None and "\n" not in line
    assert f"bucket {key[2]} of buffer {key[1]} of optimizer {key[0]}" in line and says in line
    assert "--ddp-bucket-size" in line


def test_a_bucket_without_a_saved_shard_fits():
    """Its weights were not quantized (data-parallel size 1, or no qWD): megatron's
    saved weights are the exact ones."""
    sizes = fp32_shard_sizes(_Adapter(), _moe_chain())
    assert misfit({(0, 0, 0): torch.zeros(20)}, sizes) is None
