"""Data tokenized with another vocabulary is refused at set-up, in one line naming
the data, its largest id and the tokenizer (``data/token_ids.py``).

Before: training started and the first sample holding an id past the embedding
table stopped it with ``IndexError: index out of range in self`` (on a GPU a
device-side assert), after the whole set-up.
"""
import os
from dataclasses import dataclass

import numpy
import pytest

from megatron_sdp4bit.data import token_ids
from megatron_sdp4bit.data.indexed_files import write_indexed_dataset
from megatron_sdp4bit.data.token_ids import check_vocabulary, token_range


@dataclass
class FakeTokenizer:
    vocab_size: int
    eod: int = 0
    name: str = "GPT2BPETokenizer"
    source: str = "vocab.json"


def _data(tmp_path, name, documents, vocab_size):
    prefix = str(tmp_path / name)
    write_indexed_dataset(prefix, documents, vocab_size)
    return prefix


@pytest.fixture
def scans(monkeypatch):
    """How often a .bin is read."""
    calls = []
    real = token_ids.scan_token_range

    def counted(path, dtype):
        calls.append(path)
        return real(path, dtype)
    monkeypatch.setattr(token_ids, "scan_token_range", counted)
    return calls


def test_ids_past_the_vocabulary_are_refused_naming_both(tmp_path):
    prefix = _data(tmp_path, "made_with_8192", [[1, 2, 8191], [5, 0]], 8192)
    with pytest.raises(ValueError) as error:
        check_vocabulary(prefix, FakeTokenizer(281), str(tmp_path / "cache"))
    message = str(error.value)
    assert "\n" not in message
    assert f"{prefix}.bin holds token id 8191" in message
    assert "GPT2BPETokenizer from vocab.json: 281 ids, 0-280" in message
    check_vocabulary(prefix, FakeTokenizer(8192), str(tmp_path / "cache"))  # its own vocabulary: fine


def test_int32_data_is_checked_too(tmp_path):
    prefix = _data(tmp_path, "big_vocab", [[70_000, 3]], 100_000)  # int32 on disk (vocabulary >= 65500)
    with pytest.raises(ValueError, match="holds token id 70000"):
        check_vocabulary(prefix, FakeTokenizer(50_257), None)


def test_the_scan_is_kept_and_redone_only_when_the_file_changes(tmp_path, scans):
    cache = str(tmp_path / "cache")
    prefix = _data(tmp_path, "d", [[1, 2, 300]], 1000)
    assert token_range(prefix, cache) == (1, 300)
    assert token_range(prefix, cache) == (1, 300) and len(scans) == 1  # the second from the cache
    _data(tmp_path, "d", [[7, 900]], 1000)
    assert token_range(prefix, cache) == (7, 900) and len(scans) == 2


def test_no_scan_where_the_dtype_cannot_hold_a_bad_id(tmp_path, scans):
    prefix = _data(tmp_path, "small", [[1, 2, 3]], 1000)  # uint16
    check_vocabulary(prefix, FakeTokenizer(70_000), str(tmp_path / "cache"))
    assert scans == []


def test_an_unwritable_cache_only_means_no_cache(tmp_path, scans):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    prefix = _data(tmp_path, "d", [[1, 2, 300]], 1000)
    assert token_range(prefix, str(not_a_folder)) == (1, 300)
    assert token_range(prefix, str(not_a_folder)) == (1, 300) and len(scans) == 2


def test_the_scan_reads_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(token_ids, "CHUNK_IDS", 3)
    ids = numpy.random.default_rng(0).integers(0, 5000, size=100)
    prefix = _data(tmp_path, "d", [ids.tolist()], 8192)
    assert token_range(prefix) == (int(ids.min()), int(ids.max()))


def test_documents_ending_with_another_tokenizers_eod_are_warned(tmp_path):
    """Ids that fit the vocabulary but come from another tokenizer (the embedded corpus's,
    EOD 0, read as GPT-2's, EOD 50256) trained silently on nonsense."""
    from megatron_sdp4bit.data.token_ids import eod_mismatch

    prefix = _data(tmp_path, "stdlib_made", [[5, 9, 0], [7, 0], [3, 3, 3, 0]], 8192)
    warning = eod_mismatch(prefix, FakeTokenizer(50_257, eod=50_256))
    assert warning.startswith(f"warning: all 3 first documents of {prefix} end with token id 0, not the "
                              "end-of-document id 50256 of the tokenizer (GPT2BPETokenizer from vocab.json)")
    assert eod_mismatch(prefix, FakeTokenizer(8192, eod=0)) is None  # its own tokenizer
    mixed = _data(tmp_path, "no_eod", [[5, 9], [7, 1], [3, 3]], 8192)  # preprocessed without --append-eod
    assert eod_mismatch(mixed, FakeTokenizer(50_257, eod=50_256)) is None
