"""The default corpus: the running interpreter's own standard library source.

Every machine that runs this package already has it, so training works with no
download and no data set to hand over. It is real text: Python code with its
comments and docstrings (English prose), about 30 MB for CPython 3.11 with its
test suite. Each ``*.py`` file under ``sysconfig.get_paths()['stdlib']`` is one
document, read in sorted path order (``site-packages``/``dist-packages`` and
``__pycache__`` excluded; the few test files that are deliberately not UTF-8 are
skipped). A byte-level BPE is trained on exactly those documents with fixed
settings, then the documents are tokenized (EOD appended) into a Megatron
indexed dataset. Both are cached::

    $SDP4BIT_CACHE (default ~/.cache/megatron_sdp4bit)/
        stdlib-py3.11.7-bpe8192-all/
            tokenizer.json  stdlib_text_document.bin  stdlib_text_document.idx
            meta.json       (files, bytes, tokens, seconds: what docs/data.md quotes)

The directory name holds everything the content depends on (Python version,
vocabulary size, size cap, tests in or out), so changing any of them builds a
new entry instead of reusing a wrong one.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
from typing import Iterator, List, Optional, Tuple

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatron_sdp4bit.data.cache import build_once, cache_error, default_cache_dir
from megatron_sdp4bit.data.indexed_files import write_indexed_dataset
from megatron_sdp4bit.data.tokenizer import EOD_TOKEN, Tokenizer, load_huggingface

DEFAULT_VOCAB_SIZE = 8192
CORPUS_NAME = "stdlib_text_document"
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_source_files(stdlib_dir: Optional[str] = None, include_tests: bool = True) -> List[Tuple[str, str]]:
    """``(relative posix path, absolute path)`` of every stdlib ``*.py``, sorted."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS
                      and (include_tests or d not in _TEST_DIRS)]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    found.sort()
    return found


def stdlib_documents(max_bytes: Optional[int] = None, include_tests: bool = True,
                     stdlib_dir: Optional[str] = None) -> Iterator[str]:
    """The corpus documents in order: each readable UTF-8 file, whole.

    With ``max_bytes`` it stops after the file that reaches that many bytes (whole
    files only, so the cut is the same on every run).
    """
    total = 0
    for _, path in stdlib_source_files(stdlib_dir, include_tests):
        try:
            with open(path, encoding="utf-8", newline="") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # a handful of encoding tests are Latin-1 on purpose
        yield text
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            return


def train_byte_level_bpe(documents: Iterator[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> tokenizers.Tokenizer:
    """A GPT-2-style byte-level BPE (no prefix space, EOD as the only special token,
    id 0) trained on ``documents`` with fixed settings."""
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte tokens + EOD, got {vocab_size}.")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer)
    return backend


def default_corpus_dir(cache_dir: Optional[str] = None, max_mb: Optional[float] = None,
                       vocab_size: int = DEFAULT_VOCAB_SIZE, include_tests: bool = True) -> str:
    """Where the default corpus with these settings is (or will be) cached."""
    version = ".".join(map(str, sys.version_info[:3]))
    size = "all" if max_mb is None else f"{max_mb:g}mb"
    tests = "" if include_tests else "-notests"
    return os.path.join(cache_dir or default_cache_dir(), f"stdlib-py{version}-bpe{vocab_size}-{size}{tests}")


def _build_corpus(out_dir: str, max_bytes: Optional[int], vocab_size: int, include_tests: bool) -> None:
    start = time.perf_counter()
    backend = train_byte_level_bpe(stdlib_documents(max_bytes, include_tests), vocab_size)
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    trained = time.perf_counter()
    tokenizer = Tokenizer(backend, EOD_TOKEN, "StdlibBPETokenizer", out_dir)
    counts = {"files": 0, "bytes": 0, "tokens": 0}

    def encoded() -> Iterator[List[int]]:
        batch: List[str] = []
        docs = stdlib_documents(max_bytes, include_tests)
        for text in docs:
            batch.append(text)
            if len(batch) == 256:
                yield from tokenizer.tokenize_batch(batch)
                batch = []
        yield from tokenizer.tokenize_batch(batch)

    def with_eod() -> Iterator[List[int]]:
        for ids in encoded():
            ids.append(tokenizer.eod)
            counts["files"] += 1
            counts["tokens"] += len(ids)
            yield ids

    for text in stdlib_documents(max_bytes, include_tests):
        counts["bytes"] += len(text.encode("utf-8"))
    write_indexed_dataset(os.path.join(out_dir, CORPUS_NAME), with_eod(), tokenizer.vocab_size)
    meta = dict(
        counts,
        python=sys.version.split()[0],
        stdlib=sysconfig.get_paths()["stdlib"],
        include_tests=include_tests,
        max_bytes=max_bytes,
        vocab_size=tokenizer.vocab_size,
        eod=tokenizer.eod,
        seconds_train_tokenizer=round(trained - start, 2),
        seconds_total=round(time.perf_counter() - start, 2),
    )
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def prepare_default_corpus(cache_dir: Optional[str] = None, max_mb: Optional[float] = None,
                           vocab_size: int = DEFAULT_VOCAB_SIZE, include_tests: bool = True) -> str:
    """Build (once) and return the ``--data-path`` prefix of the default corpus.

    Idempotent and safe to call from every rank at once: the first caller builds,
    the others wait for it and reuse the result. ``max_mb`` caps the text (MiB,
    whole files) for quick runs; its tokenizer is trained on that text only.
    The tokenizer is ``load_default_corpus_tokenizer(prefix)``.
    """
    if max_mb is not None and max_mb <= 0:
        raise ValueError(f"max_mb must be positive (or None for the whole stdlib), got {max_mb}.")
    max_bytes = None if max_mb is None else int(max_mb * (1 << 20))
    final_dir = default_corpus_dir(cache_dir, max_mb, vocab_size, include_tests)
    try:
        build_once(final_dir, lambda tmp: _build_corpus(tmp, max_bytes, vocab_size, include_tests))
    except OSError as error:  # the stdlib's files are read leniently: this is the cache folder
        raise cache_error(cache_dir or default_cache_dir(), error,
                          flag=None if cache_dir is None else "--cache-dir") from None
    return os.path.join(final_dir, CORPUS_NAME)


def load_default_corpus_tokenizer(prefix: str) -> Tokenizer:
    """The tokenizer a ``prepare_default_corpus`` prefix was tokenized with."""
    directory = os.path.dirname(os.path.abspath(prefix))
    return load_huggingface(os.path.join(directory, "tokenizer.json"), EOD_TOKEN, "StdlibBPETokenizer")


def default_corpus_meta(prefix: str) -> dict:
    """The counts and timings recorded when the corpus at ``prefix`` was built."""
    with open(os.path.join(os.path.dirname(os.path.abspath(prefix)), "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def default_tokenizer(cache_dir: Optional[str] = None, max_mb: Optional[float] = None) -> Tokenizer:
    """The StdlibBPETokenizer (built with the whole default corpus if not cached)."""
    return load_default_corpus_tokenizer(prepare_default_corpus(cache_dir, max_mb))


if __name__ == "__main__":  # python -m megatron_sdp4bit.data.corpus [MAX_MB]: build and report
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else None
    t0 = time.perf_counter()
    corpus_prefix = prepare_default_corpus(max_mb=mb)
    print(corpus_prefix)
    print(json.dumps(default_corpus_meta(corpus_prefix), indent=2))
    print(f"this call: {time.perf_counter() - t0:.2f} s")
