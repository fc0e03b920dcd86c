"""The largest token id in a ``.bin``, against the tokenizer's vocabulary.

Data tokenized with another vocabulary trains until the first sample holding an
id past the embedding table: an ``IndexError`` on CPU, a device-side assert on a
GPU, after the whole set-up. ``check_vocabulary`` says it at set-up, in one line
naming the data, its largest id and the tokenizer's vocabulary.

Cost. The ``.idx`` does not record the vocabulary, so the ids must be read:

- when the ``.bin``'s dtype cannot hold an id outside the vocabulary (uint16
  data, a vocabulary of 65,536 or more) nothing is read;
- else the ``.bin`` is scanned once, memory-mapped, in chunks of 16 Mi ids
  (NumPy's max, about 2.7 GB/s from the page cache on the 2-core development
  machine: a 10 GB file takes seconds, a 100 GB one under a minute from cache),
  and the result is kept in the dataset index cache (``--data-cache-path``, by
  default ``$SDP4BIT_CACHE/dataset_indices``), keyed by the file's path, size
  and modification time, so later starts read one small JSON file. An
  unwritable cache only means the scan is not kept.

The other way round (ids that all fit, from another tokenizer) reads no id past
the table and trains on nonsense; ``eod_mismatch`` catches the usual case, data
preprocessed with ``--append-eod``: its documents all end with the other
tokenizer's end-of-document id (the last id of the first 1000 documents is read).

Nothing here needs a process group: every rank can check alike.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Optional, Tuple

import numpy

from megatron_sdp4bit.data.indexed_files import INDEX_HEADER_BYTES, check_indexed_prefix, sequence_lengths

CHUNK_IDS = 1 << 24
"""Ids read per step of the scan (32 MiB of uint16 data): bounded memory."""
CACHE_SUBDIR = "token_ranges"


def scan_token_range(bin_path: str, dtype) -> Tuple[int, int]:
    """(smallest, largest) id in ``bin_path``, read in chunks; (0, -1) for an empty file."""
    if os.path.getsize(bin_path) == 0:
        return 0, -1
    ids = numpy.memmap(bin_path, dtype=dtype, mode="r")
    low, high = None, None
    for start in range(0, ids.size, CHUNK_IDS):
        chunk = ids[start:start + CHUNK_IDS]
        chunk_low, chunk_high = int(chunk.min()), int(chunk.max())
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
    del ids
    return low, high


def _cache_file(bin_path: str, cache_dir: str) -> Tuple[str, dict]:
    """Where the scan of ``bin_path`` is kept, and what it must match there."""
    real = os.path.realpath(bin_path)
    stat = os.stat(real)
    key = {"bin": real, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    name = hashlib.sha1(real.encode("utf-8")).hexdigest()[:16]
    return os.path.join(cache_dir, CACHE_SUBDIR, f"{os.path.basename(real)}-{name}.json"), key


def _read_cached(path: str, key: dict) -> Optional[Tuple[int, int]]:
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if all(saved.get(k) == v for k, v in key.items()):
            return int(saved["min_id"]), int(saved["max_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_cached(path: str, key: dict, token_range: Tuple[int, int]) -> None:
    """Keep the scan; a folder that cannot be written only means no cache."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".part",
                                         delete=False, encoding="utf-8") as f:
            json.dump({**key, "min_id": token_range[0], "max_id": token_range[1]}, f)
        os.replace(f.name, path)
    except OSError:
        pass


def token_range(prefix: str, cache_dir: Optional[str] = None) -> Tuple[int, int]:
    """(smallest, largest) token id in ``PREFIX.bin``: from the cache in ``cache_dir``
    when the file has not changed since it was scanned, else scanned (and kept there)."""
    info = check_indexed_prefix(prefix)
    bin_path = prefix + ".bin"
    if cache_dir is None:
        return scan_token_range(bin_path, info.token_dtype)
    path, key = _cache_file(bin_path, cache_dir)
    cached = _read_cached(path, key)
    if cached is not None:
        return cached
    found = scan_token_range(bin_path, info.token_dtype)
    _write_cached(path, key, found)
    return found


def describe_tokenizer(tokenizer) -> str:
    """``GPT2BPETokenizer from vocab.json`` (ours), or the class name (a megatron one)."""
    name = getattr(tokenizer, "name", None) or type(tokenizer).__name__
    source = getattr(tokenizer, "source", None)
    return f"{name} from {source}" if source else name


def check_vocabulary(prefix: str, tokenizer, cache_dir: Optional[str] = None) -> None:
    """ValueError, one line, when ``PREFIX.bin`` holds an id outside ``[0, vocab_size)``
    of ``tokenizer``."""
    vocab_size = tokenizer.vocab_size
    dtype = check_indexed_prefix(prefix).token_dtype
    info = numpy.iinfo(dtype) if numpy.issubdtype(dtype, numpy.integer) else None
    if info is not None and info.min >= 0 and info.max < vocab_size:
        return  # the dtype cannot hold an id outside the vocabulary: nothing to read
    low, high = token_range(prefix, cache_dir)
    if high < 0 or (low >= 0 and high < vocab_size):
        return
    bad = high if high >= vocab_size else low
    raise ValueError(
        f"{prefix}.bin holds token id {bad}, outside the vocabulary of the tokenizer "
        f"({describe_tokenizer(tokenizer)}: {vocab_size} ids, 0-{vocab_size - 1}): the data was "
        "preprocessed with another tokenizer; pass the --tokenizer-type and --vocab-file/--merge-file "
        "or --tokenizer-model it was made with, or preprocess the text again with this one")


EOD_SAMPLE = 1000
"""Documents whose last token ``eod_mismatch`` reads (the first ones of the file)."""


def last_tokens(prefix: str, count: int = EOD_SAMPLE) -> numpy.ndarray:
    """The last token of each of the first ``count`` sequences of ``PREFIX``."""
    info = check_indexed_prefix(prefix)
    n = min(count, info.num_sequences)
    if n == 0:
        return numpy.zeros(0, dtype=numpy.int64)
    lengths = sequence_lengths(prefix)[:n].astype(numpy.int64)
    pointers = numpy.memmap(prefix + ".idx", dtype="<i8", mode="r", shape=(n,),
                            offset=INDEX_HEADER_BYTES + 4 * info.num_sequences)
    itemsize = numpy.dtype(info.token_dtype).itemsize
    ids = numpy.memmap(prefix + ".bin", dtype=info.token_dtype, mode="r")
    ends = (numpy.asarray(pointers) // itemsize + lengths - 1)[lengths > 0]
    return numpy.asarray(ids[ends], dtype=numpy.int64)


def eod_mismatch(prefix: str, tokenizer) -> Optional[str]:
    """A warning when the documents of ``PREFIX`` all end with one id that is not the
    tokenizer's end-of-document id: data preprocessed with ``--append-eod`` and
    another tokenizer whose ids all fit this vocabulary (``check_vocabulary`` cannot
    see it). A warning, not a refusal: data preprocessed without ``--append-eod`` may
    end every document with one token too (a newline)."""
    ends = last_tokens(prefix)
    if len(ends) < 2:
        return None
    values, counts = numpy.unique(ends, return_counts=True)
    common = int(values[counts.argmax()])
    if counts.max() < len(ends) or common == tokenizer.eod:
        return None
    return (f"warning: all {len(ends)} first documents of {prefix} end with token id {common}, not the "
            f"end-of-document id {tokenizer.eod} of the tokenizer ({describe_tokenizer(tokenizer)}): if the data "
            "was preprocessed with --append-eod, it was with another tokenizer (check --tokenizer-type and its "
            "files)")
