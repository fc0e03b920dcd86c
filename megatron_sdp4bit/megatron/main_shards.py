"""The exact fp32 main shards in the layer's saved state: their keys, and whether they fit.

With fp32 params under qWD, megatron's main weights are the param buffer itself, which
holds the reconstruction every rank shares; the layer keeps this rank's exact 1/DP shard
of each fp32 bucket beside it (``BucketState.main_shard``) and a checkpoint carries them.
A shard is saved under its bucket's place in megatron's optimizer chain, ``(sub-optimizer,
buffer, bucket)``: with experts megatron chains a dense and an expert distributed
optimizer, and each numbers its buffers and buckets from 0.

Releases before this one keyed them by ``(buffer, bucket)`` alone, so in a chain the
expert optimizer's shards replaced the dense one's under the same keys, and a resume put
an expert bucket's exact weights where a dense bucket's belonged (dropped at the next
step when their sizes differed, taken when they matched). Such a checkpoint is read as
that save wrote it: each old key holds the shard of the last sub-optimizer that had the
key; the buckets whose shards it replaced continue from the reconstructed weights megatron
saved, said in one warning.

A saved shard that does not fit this rank's bucket (another ``--ddp-bucket-size``,
data-parallel size or model) is refused in one line, on every rank alike, before the
layer takes any state: taking it would give a rank wrong weights, dropping it would
quietly leave the exact run.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

Key = Tuple[int, int, int]
"""(sub-optimizer, buffer, bucket): a bucket's place in megatron's optimizer chain."""


def chain_buckets(adapter, optimizer) -> Iterator[Tuple[Key, Any, Any]]:
    """(key, sub-optimizer, bucket) of every bucket of megatron's optimizer chain, in order."""
    for index, opt in enumerate(adapter.sub_optimizers(optimizer)):
        for (buffer, bucket_index), bucket in adapter.buffer_buckets(opt):
            yield (index, buffer, bucket_index), opt, bucket


def fp32_buckets(adapter, optimizer) -> Dict[Key, Tuple[int, int]]:
    """(this rank's shard size, the data-parallel size) of every bucket of fp32 params, in
    the chain's order."""
    buckets = {}
    for key, opt, bucket in chain_buckets(adapter, optimizer):
        if adapter.bucket_param_data(bucket).dtype == torch.float32:
            # asked only for an optimizer with buckets: a plain one has no data-parallel group
            rank, size = adapter.optimizer_group(opt)
            buckets[key] = (adapter.param_shard(bucket, size, rank).numel(), size)
    return buckets


def under_current_keys(saved: dict, buckets: Dict[Key, Tuple[int, int]]) -> Tuple[dict, List[Key]]:
    """(``saved``'s shards keyed as this release keys them, the buckets whose shard an older
    save replaced with another sub-optimizer's). ``buckets``: this run's fp32 buckets
    (``fp32_buckets``), whose layout the saved run had."""
    old = [key for key in saved if len(key) == 2]
    if not old:
        return dict(saved), []
    owner = {}
    for key, (_, size) in buckets.items():  # in the chain's order, as the older save iterated
        if size > 1:  # only a gathered bucket had a main shard to save (and to replace)
            owner[key[1:]] = key  # its dict kept the last sub-optimizer's shard
    shards = {key: shard for key, shard in saved.items() if len(key) == 3}
    shards.update({owner.get(key, (0, *key)): saved[key] for key in old})
    replaced = [key for key, (_, size) in buckets.items()
                if size > 1 and key not in shards and key[1:] in saved]
    return shards, replaced


def misfit(shards: dict, buckets: Dict[Key, Tuple[int, int]]) -> Optional[str]:
    """The line refusing saved ``shards`` that do not fit this rank's fp32 ``buckets``
    (``fp32_buckets``); None when each has its bucket, of its size. A bucket without a
    saved shard is fine: its weights were not quantized (a data-parallel size of 1, or a
    preset without qWD), so megatron's saved weights are the exact ones."""
    for key, shard in shards.items():
        size = buckets[key][0] if key in buckets else None
        if size != shard.numel():
            held = (f"of {size} elements here" if size is not None else
                    "which this run does not have (no such bucket of fp32 params)")
            return (f"its exact fp32 main shard of bucket {key[2]} of buffer {key[1]} of optimizer {key[0]} "
                    f"has {shard.numel()} elements, this rank's shard of that bucket is one {held}: the "
                    "checkpoint was saved with another DDP bucket size (--ddp-bucket-size), data-parallel "
                    "size or model; resume with the saved run's")
    return None
