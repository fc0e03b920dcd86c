"""Bad data gives an error that names the file and says what to do, before
megatron-core can fail obscurely (or hang)."""
import os
import shutil
import struct

import pytest

from megatron_sdp4bit.data import load_default_corpus_tokenizer
from megatron_sdp4bit.data.gpt_datasets import build_gpt_datasets, parse_data_path
from megatron_sdp4bit.data.indexed_files import check_indexed_prefix


@pytest.fixture
def copy_of_corpus(small_corpus_prefix, tmp_path):
    prefix = str(tmp_path / "copy_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(small_corpus_prefix + ext, prefix + ext)
    return prefix, load_default_corpus_tokenizer(small_corpus_prefix)


def _build(prefix, tokenizer, tmp_path, **kwargs):
    return build_gpt_datasets(prefix, tokenizer, 32, 10, 2, 1, split="90,8,2",
                              path_to_cache=str(tmp_path / "cache"), **kwargs)


@pytest.mark.parametrize("remove", [[".bin"], [".idx"], [".bin", ".idx"]])
def test_missing_files_are_named(copy_of_corpus, tmp_path, remove):
    prefix, tokenizer = copy_of_corpus
    for ext in remove:
        os.remove(prefix + ext)
    with pytest.raises(FileNotFoundError) as error:
        _build(["1", prefix, "1", str(tmp_path / "other")], tokenizer, tmp_path)
    message = str(error.value)
    for ext in remove:
        assert prefix + ext in message
    assert str(tmp_path / "other") + ".bin" in message and str(tmp_path / "other") + ".idx" in message


def _rewrite(path, edit):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(edit(data))


@pytest.mark.parametrize("damage, words", [
    (lambda d: b"GARBAGE!!" + d[9:], "does not start with"),
    (lambda d: d[:20], "shorter than"),
    (lambda d: d[:-8], "need"),
    (lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], "version 2"),
    (lambda d: d[:17] + bytes([42]) + d[18:], "dtype code 42"),
    (lambda d: d + b"\0" * 5, "need"),
])
def test_corrupt_index_is_named(copy_of_corpus, tmp_path, damage, words):
    prefix, tokenizer = copy_of_corpus
    _rewrite(prefix + ".idx", damage)
    with pytest.raises(ValueError) as error:
        _build(prefix, tokenizer, tmp_path)
    message = str(error.value)
    assert prefix + ".idx" in message and words in message and "re-run preprocessing" in message


def test_bin_that_does_not_match_its_index(copy_of_corpus, tmp_path):
    prefix, _ = copy_of_corpus
    _rewrite(prefix + ".bin", lambda d: d[:-2])
    with pytest.raises(ValueError, match="does not belong together or one is truncated"):
        check_indexed_prefix(prefix)


def test_document_boundaries_checked(copy_of_corpus):
    prefix, _ = copy_of_corpus
    info = check_indexed_prefix(prefix)
    offset = 34 + 12 * info.num_sequences  # first document boundary
    _rewrite(prefix + ".idx", lambda d: d[:offset] + struct.pack("<q", 5) + d[offset + 8:])
    with pytest.raises(ValueError, match="document boundaries"):
        check_indexed_prefix(prefix)


def test_split_without_documents_fails_instead_of_hanging(copy_of_corpus, tmp_path):
    prefix, tokenizer = copy_of_corpus
    with pytest.raises(ValueError, match="gives the validation set no document"):
        build_gpt_datasets(prefix, tokenizer, 32, 10, 2, 1, split="999999,1,1",
                           path_to_cache=str(tmp_path / "c"))


@pytest.mark.parametrize("data_path, words", [
    ([], "empty"),
    (["1", "a", "b"], "weight/prefix pairs"),
    (["0", "a", "1", "b"], "positive"),
    (["a.bin"], "not files"),
])
def test_bad_data_path(data_path, words):
    with pytest.raises(ValueError, match=words):
        parse_data_path(data_path)


def test_bad_arguments(copy_of_corpus, tmp_path):
    prefix, tokenizer = copy_of_corpus
    with pytest.raises(ValueError, match="seq_length"):
        build_gpt_datasets(prefix, tokenizer, 1, 10, 2, 1)
    with pytest.raises(ValueError, match="train_samples"):
        build_gpt_datasets(prefix, tokenizer, 8, -1, 2, 1)
    with pytest.raises(ValueError, match="explicit train/valid/test sample counts"):
        build_gpt_datasets(["1", prefix], tokenizer, 8, None, 2, 1)
    with pytest.raises(ValueError, match="has no vocab_size"):
        build_gpt_datasets(prefix, object(), 8, 10, 2, 1)


def test_a_prefix_without_files_names_what_it_probably_meant(copy_of_corpus, tmp_path):
    """Before: only the missing files, for the two commonest slips: the --output-prefix
    given to the preprocessor (which adds _text_document), and a folder."""
    from megatron_sdp4bit.data.gpt_datasets import check_data_path

    prefix, _ = copy_of_corpus  # tmp_path/copy_text_document
    with pytest.raises(FileNotFoundError) as error:
        check_data_path([str(tmp_path / "copy")])
    assert f"the preprocessor adds _KEY_document to its --output-prefix: {tmp_path / 'copy'} -> {prefix}" \
        in str(error.value)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} is a folder holding {prefix}"):
        check_data_path([str(tmp_path)])
