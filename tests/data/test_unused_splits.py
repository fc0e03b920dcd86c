"""A split the caller reads nothing from (0 samples) is neither checked nor built.

The driver never evaluates on the test split, so the default ``--split 969,30,1``
on a small corpus (``--default-corpus-mb 2``) was refused because the test set
got no document (issue 18 item 8). The weights still place the other splits'
bounds: the train and validation sets hold the same documents as before.
"""
import pytest

from megatron_sdp4bit.data import load_default_corpus_tokenizer
from megatron_sdp4bit.data.gpt_datasets import build_gpt_datasets, check_gpt_data
from megatron_sdp4bit.data.indexed_files import check_indexed_prefix


def test_a_split_of_0_samples_is_not_built_and_the_others_keep_their_documents(small_corpus_prefix, tmp_path):
    tokenizer = load_default_corpus_tokenizer(small_corpus_prefix)
    documents = check_indexed_prefix(small_corpus_prefix).num_sequences
    assert round(0.999 * documents) == round(documents)  # the test set (weight 1 of 1000) gets none
    with pytest.raises(ValueError, match="gives the test set no document"):
        check_gpt_data([small_corpus_prefix], "969,30,1", (10, 2, 1))
    train, valid, test = build_gpt_datasets(small_corpus_prefix, tokenizer, 32, 10, 2, 0, split="969,30,1",
                                            path_to_cache=str(tmp_path / "cache"))
    assert test is None
    first_valid = round(0.969 * documents)
    assert sorted(train.indices) == list(range(first_valid))
    assert sorted(valid.indices) == list(range(first_valid, round(0.999 * documents)))
    _, no_valid, _ = build_gpt_datasets(small_corpus_prefix, tokenizer, 32, 10, 0, 0, split="969,30,1",
                                        path_to_cache=str(tmp_path / "cache"))
    assert no_valid is None
