"""The default corpus: built once, reused, race-safe, and what its metadata says."""
import os
import threading
import time

import pytest

from megatron_sdp4bit.data import corpus
from megatron_sdp4bit.data.cache import build_once, default_cache_dir
from megatron_sdp4bit.data.indexed_files import check_indexed_prefix

from data_samples import read_indexed


def test_prepare_is_idempotent(small_corpus_prefix, monkeypatch):
    # small_corpus_prefix is prepare_default_corpus(cache_dir=CACHE, max_mb=1).
    cache = os.path.dirname(os.path.dirname(small_corpus_prefix))
    prefix = small_corpus_prefix
    stamps = {name: os.stat(os.path.join(os.path.dirname(prefix), name)).st_mtime_ns
              for name in os.listdir(os.path.dirname(prefix))}

    def no_retraining(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(corpus, "train_byte_level_bpe", no_retraining)
    assert corpus.prepare_default_corpus(cache_dir=cache, max_mb=1) == prefix
    assert {name: os.stat(os.path.join(os.path.dirname(prefix), name)).st_mtime_ns
            for name in os.listdir(os.path.dirname(prefix))} == stamps
    # Another size is another entry (and would need training).
    with pytest.raises(AssertionError, match="trained again"):
        corpus.prepare_default_corpus(cache_dir=cache, max_mb=0.5)
    # The failed build left no directory behind, only its (empty) lock file.
    assert [n for n in os.listdir(cache) if not n.endswith(".lock")] == [
        os.path.basename(os.path.dirname(prefix))]


def test_small_corpus_contents(small_corpus_prefix):
    meta = corpus.default_corpus_meta(small_corpus_prefix)
    documents, _ = read_indexed(small_corpus_prefix)
    tokenizer = corpus.load_default_corpus_tokenizer(small_corpus_prefix)
    assert tokenizer.vocab_size == meta["vocab_size"] == corpus.DEFAULT_VOCAB_SIZE
    assert meta["files"] == len(documents)
    assert meta["tokens"] == sum(map(len, documents)) == check_indexed_prefix(small_corpus_prefix).num_tokens
    assert (1 << 20) <= meta["bytes"] < (1 << 20) + 1_000_000  # stops at the file that crosses 1 MiB
    # Documents are the stdlib files in sorted order, each ending with EOD.
    texts = list(corpus.stdlib_documents(max_bytes=1 << 20))
    assert len(texts) == len(documents)
    for i in (0, len(texts) // 2, len(texts) - 1):
        assert documents[i][-1] == tokenizer.eod
        assert tokenizer.detokenize(documents[i][:-1]) == texts[i]
    first = corpus.stdlib_source_files()[0]
    with open(first[1], encoding="utf-8", newline="") as f:
        assert f.read() == texts[0]


def test_source_files_exclude_site_packages():
    files = corpus.stdlib_source_files()
    paths = [rel for rel, _ in files]
    assert paths == sorted(paths) and len(paths) > 500
    assert not any("site-packages" in p or "__pycache__" in p for p in paths)
    assert "os.py" in paths
    without_tests = [rel for rel, _ in corpus.stdlib_source_files(include_tests=False)]
    assert not any(p.startswith("test/") for p in without_tests) and len(without_tests) < len(paths)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SDP4BIT_CACHE", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)
    assert corpus.default_corpus_dir(max_mb=2).startswith(str(tmp_path))
    monkeypatch.delenv("SDP4BIT_CACHE")
    assert default_cache_dir().endswith(os.path.join(".cache", "megatron_sdp4bit"))


def test_build_once_under_a_race(tmp_path):
    calls = []

    def slow_build(directory):
        calls.append(directory)
        with open(os.path.join(directory, "part1"), "w") as f:
            f.write("x")
        time.sleep(0.3)
        with open(os.path.join(directory, "part2"), "w") as f:
            f.write("y")

    target = str(tmp_path / "artifact")
    results = []
    threads = [threading.Thread(target=lambda: results.append(build_once(target, slow_build)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [target] * 3
    assert len(calls) == 1
    assert sorted(os.listdir(target)) == ["part1", "part2"]
    assert sorted(os.listdir(tmp_path)) == ["artifact", "artifact.lock"]  # no temp left


def test_failed_build_leaves_nothing(tmp_path):
    def broken(directory):
        open(os.path.join(directory, "half"), "w").close()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(str(tmp_path / "a"), broken)
    assert sorted(os.listdir(tmp_path)) == ["a.lock"]
