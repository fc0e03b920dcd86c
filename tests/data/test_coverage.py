"""Data too small for the run is refused with numbers and a fix that works
(``data/coverage.py``); the counts are megatron-core's.

Before: a training set shorter than one sample trained on copies of itself for
hundreds of epochs without a word; two ``--data-path`` prefixes without weights
stopped part way through training with ``StopIteration`` (megatron-core reads
such a blend once), or, a prefix below one sample, with a bare ``AssertionError``.
"""
import re

import pytest

from megatron_sdp4bit.data import load_default_corpus_tokenizer
from megatron_sdp4bit.data.coverage import set_reads
from megatron_sdp4bit.data.gpt_datasets import build_gpt_datasets
from megatron_sdp4bit.data.indexed_files import write_indexed_dataset


@pytest.fixture
def tokenizer(small_corpus_prefix):
    return load_default_corpus_tokenizer(small_corpus_prefix)


def _data(tmp_path, name, lengths):
    prefix = str(tmp_path / name)
    write_indexed_dataset(prefix, [[(7 * i + j) % 8000 + 1 for j in range(n)] for i, n in enumerate(lengths)], 8192)
    return prefix


def _build(data_path, tokenizer, tmp_path, seq_length, train_samples):
    return build_gpt_datasets(data_path, tokenizer, seq_length, train_samples, 0, 0, split="1,0,0",
                              path_to_cache=str(tmp_path / "cache"))[0]


def test_a_set_smaller_than_one_sample_is_refused_and_the_suggested_length_builds(tmp_path, tokenizer):
    prefix = _data(tmp_path, "tiny", [5, 7])  # 12 tokens
    with pytest.raises(ValueError) as error:
        _build(prefix, tokenizer, tmp_path, 32, 4)
    message = str(error.value)
    assert "training set of" in message and "holds 12 tokens, fewer than one sample of --seq-length 32" in message
    suggested = int(re.search(r"--seq-length of at most (\d+)", message).group(1))
    assert len(_build(prefix, tokenizer, tmp_path, suggested, 4)) >= 4


def test_samples_per_epoch_are_megatrons(tmp_path, tokenizer):
    prefix = _data(tmp_path, "d", [40, 13, 77, 5])
    (read,) = set_reads([prefix], None, "1,0,0", 16, [1, 0, 0])
    assert read.tokens == 135
    one_epoch = build_gpt_datasets(prefix, tokenizer, 16, None, 0, 0, split="1,0,0",
                                   path_to_cache=str(tmp_path / "cache"))[0]
    assert len(one_epoch) == read.samples_per_epoch == 8
    assert read.epochs <= 1 < set_reads([prefix], None, "1,0,0", 16, [9, 0, 0])[0].epochs


def test_an_unweighted_blend_that_would_run_out_is_refused_and_weights_repeat_it(tmp_path, tokenizer):
    a, b = _data(tmp_path, "a", [100, 60]), _data(tmp_path, "b", [90])
    available = len(_build([a, b], tokenizer, tmp_path, 16, 13))  # what megatron-core builds at most
    assert available == 13  # 9 + 5 samples of one epoch each, cut at the 13 asked
    with pytest.raises(ValueError) as error:
        _build([a, b], tokenizer, tmp_path, 16, 40)
    message = str(error.value)
    assert "their training sets hold 14 samples of --seq-length 16, the run reads 40" in message
    suggested = re.search(r"e\.g\. --data-path (.*?)\)", message).group(1).split()
    assert suggested == ["1", a, "1", b]
    assert len(_build(suggested, tokenizer, tmp_path, 16, 40)) >= 40
