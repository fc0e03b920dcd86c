"""Two gloo ranks build the same datasets from one shared index cache (rank 0
builds, rank 1 waits at megatron's barrier, then loads) and deal disjoint
micro-batches.

The ranks are forked from this process, which has already imported torch and
megatron (importing them afresh costs ~10 s per process on a loaded CI box).
"""
import os

import numpy
import pytest

from harness import spawn_ranks
from megatron_sdp4bit.data import iterate_micro_batches, load_default_corpus_tokenizer
from megatron_sdp4bit.data.gpt_datasets import build_gpt_datasets

MICRO_BATCH, SEQ, STEPS, WORLD = 2, 32, 3, 2


def _datasets(prefix, cache):
    tokenizer = load_default_corpus_tokenizer(prefix)
    return build_gpt_datasets(["1", prefix, "3", prefix], tokenizer, SEQ, 200, 20, 0,
                              split="95,5,0", seed=11, path_to_cache=cache)


def _rank(rank, world_size, prefix, cache):
    """One rank: build the datasets; its first micro-batches and some samples."""
    import torch.distributed as dist

    train, valid, _ = _datasets(prefix, cache)
    batches = iterate_micro_batches(train, MICRO_BATCH, rank, world_size)
    mine = numpy.stack([next(batches)["tokens"].numpy() for _ in range(STEPS)])
    samples = numpy.stack([train[i]["tokens"].numpy() for i in range(8)])
    valid_samples = numpy.stack([valid[i]["tokens"].numpy() for i in range(4)])
    dist.barrier()
    return {"mine": mine, "samples": samples, "valid": valid_samples}


@pytest.mark.slow
def test_two_gloo_ranks(small_corpus_prefix, tmp_path):
    cache = str(tmp_path / "shared_cache")
    results = spawn_ranks(_rank, WORLD, small_corpus_prefix, cache, timeout_s=120, start="fork")
    # Same datasets on both ranks ...
    numpy.testing.assert_array_equal(results[0]["samples"], results[1]["samples"])
    numpy.testing.assert_array_equal(results[0]["valid"], results[1]["valid"])
    # ... equal to what this process builds from the now-warm cache ...
    train, _, _ = _datasets(small_corpus_prefix, cache)
    expected = numpy.stack([train[i]["tokens"].numpy() for i in range(8)])
    numpy.testing.assert_array_equal(results[0]["samples"], expected)
    # ... and step k of rank r holds samples [k*4 + 2r, k*4 + 2r + 2).
    for rank in range(WORLD):
        mine = results[rank]["mine"]
        for step in range(STEPS):
            for b in range(MICRO_BATCH):
                index = step * MICRO_BATCH * WORLD + rank * MICRO_BATCH + b
                numpy.testing.assert_array_equal(mine[step, b], train[index]["tokens"].numpy())
    # One set of cached indices per blend component and one for the blend.
    names = os.listdir(cache)
    assert len([n for n in names if n.endswith("GPTDataset-train-description.txt")]) == 2
    assert len([n for n in names if n.endswith("BlendedDataset-train-description.txt")]) == 1
