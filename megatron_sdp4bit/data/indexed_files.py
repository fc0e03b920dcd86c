"""Megatron's indexed dataset files (``PREFIX.bin`` + ``PREFIX.idx``): write and check.

Writing goes through megatron-core's own ``IndexedDatasetBuilder`` so the bytes
are exactly Megatron-LM's; it is imported inside the function, keeping this
module importable without megatron.

Checking is ours: megatron-core trusts the ``.idx`` and fails on a damaged one
with a bare ``assert``, a ``struct.error`` or an out-of-range read deep inside
dataset building. ``check_indexed_prefix`` reads only the fixed header and the
file sizes (O(1), cheap for every rank) and names the bad file. The layout it
checks (little endian)::

    b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 S sequences | u64 D
    | int32[S] sequence lengths | int64[S] byte offsets into .bin
    | int64[D] document boundaries (sequence indices, first 0, last S)
    | (int8[S] sequence modes, multimodal files only)
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Iterable, List, Sequence

import numpy

INDEX_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype, S, D
INDEX_HEADER_BYTES = _HEADER_SIZE
"""Where the ``.idx`` arrays start (sequence lengths, then pointers)."""
# megatron.core.datasets.indexed_dataset.DType: code -> numpy dtype
_DTYPE_BY_CODE = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32,
                  5: numpy.int64, 6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
_RERUN = "re-run preprocessing (sdp4bit-preprocess or Megatron-LM's tools/preprocess_data.py)"


@dataclass(frozen=True)
class IndexedFilesInfo:
    """What the header of a valid ``.idx`` says."""

    prefix: str
    num_sequences: int
    num_documents: int
    num_tokens: int
    token_dtype: type


def token_dtype_for(vocab_size: int) -> type:
    """The token dtype Megatron-LM picks (``DType.optimal_dtype``): uint16 when ids fit."""
    return numpy.uint16 if vocab_size < 65500 else numpy.int32


def _remove(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def write_indexed_dataset(
    prefix: str, documents: Iterable[Sequence[int]], vocab_size: int
) -> int:
    """Write ``PREFIX.bin``/``PREFIX.idx``, one document (one sequence) per item.

    Files are written under temporary names and renamed at the end, so an
    interrupted run never leaves a pair that looks valid. Empty documents are
    skipped (they hold no token to train on). Returns the number of documents;
    with none, nothing is renamed: files already at ``PREFIX`` (an earlier
    dataset) stay as they were.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = token_dtype_for(vocab_size)
    bin_tmp, idx_tmp = prefix + ".bin.tmp", prefix + ".idx.tmp"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
    count = 0
    try:
        for ids in documents:
            if len(ids) == 0:
                continue
            array = numpy.asarray(ids, dtype=numpy.int64)
            if array.min() < 0 or array.max() >= vocab_size:
                raise ValueError(
                    f"token id out of range [0, {vocab_size}) while writing {prefix}: "
                    "the tokenizer's vocab_size is wrong for its ids."
                )
            builder.add_document(array, [array.size])
            count += 1
        builder.finalize(idx_tmp)
    except BaseException:
        builder.data_file.close()
        _remove(bin_tmp, idx_tmp)
        raise
    if count == 0:  # no pair of files that looks like data, and an earlier one stays
        _remove(bin_tmp, idx_tmp)
        return 0
    os.replace(bin_tmp, prefix + ".bin")
    os.replace(idx_tmp, prefix + ".idx")
    return count


def missing_files(prefixes: Iterable[str]) -> List[str]:
    """The ``.bin``/``.idx`` files of ``prefixes`` that do not exist."""
    return [p + ext for p in prefixes for ext in (".bin", ".idx") if not os.path.isfile(p + ext)]


def sequence_lengths(prefix: str) -> numpy.ndarray:
    """Tokens of every sequence of a checked ``PREFIX.idx`` (int32, memory-mapped: the
    ``.idx`` holds 4 bytes per sequence, the ``.bin`` is not read)."""
    info = check_indexed_prefix(prefix)
    if info.num_sequences == 0:
        return numpy.zeros(0, dtype=numpy.int32)
    return numpy.memmap(prefix + ".idx", dtype="<i4", mode="r", offset=_HEADER_SIZE,
                        shape=(info.num_sequences,))


def check_indexed_prefix(prefix: str) -> IndexedFilesInfo:
    """Check that ``PREFIX.idx`` and ``PREFIX.bin`` exist and agree; say what is wrong.

    Raises:
        FileNotFoundError: a file is missing (named in the message).
        ValueError: the ``.idx`` is not a Megatron index, is truncated, or does
            not match the size of the ``.bin`` (named in the message).
    """
    missing = missing_files([prefix])
    if missing:
        raise FileNotFoundError(
            f"indexed dataset {prefix!r} is missing {', '.join(missing)}; --data-path takes "
            "the prefix shared by PREFIX.bin and PREFIX.idx."
        )
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)

    def bad(why: str) -> ValueError:
        return ValueError(f"corrupt or foreign index file {idx_path}: {why}; {_RERUN}.")

    with open(idx_path, "rb") as f:
        header = f.read(_HEADER_SIZE)
        if len(header) < _HEADER_SIZE:
            raise bad(f"{idx_size} bytes is shorter than the {_HEADER_SIZE}-byte header")
        if header[:9] != INDEX_MAGIC:
            raise bad(f"it does not start with {INDEX_MAGIC!r}")
        version, code, num_seq, num_doc = struct.unpack("<QBQQ", header[9:])
        if version != 1:
            raise bad(f"version {version}, expected 1")
        if code not in _DTYPE_BY_CODE:
            raise bad(f"unknown token dtype code {code}")
        arrays = num_seq * (4 + 8) + num_doc * 8
        if idx_size not in (_HEADER_SIZE + arrays, _HEADER_SIZE + arrays + num_seq):
            raise bad(
                f"{num_seq} sequences and {num_doc} document boundaries need "
                f"{_HEADER_SIZE + arrays} bytes, the file has {idx_size}"
            )
        if num_doc < 1:
            raise bad("no document boundaries")
        # The last sequence's offset + length must end exactly at the end of .bin.
        dtype = _DTYPE_BY_CODE[code]
        itemsize = numpy.dtype(dtype).itemsize
        if num_seq > 0:
            f.seek(_HEADER_SIZE + 4 * (num_seq - 1))
            (last_length,) = struct.unpack("<i", f.read(4))
            f.seek(_HEADER_SIZE + 4 * num_seq + 8 * (num_seq - 1))
            (last_pointer,) = struct.unpack("<q", f.read(8))
            end = last_pointer + last_length * itemsize
        else:
            end = 0
        f.seek(_HEADER_SIZE + 12 * num_seq)
        first_doc = struct.unpack("<q", f.read(8))[0]
        f.seek(_HEADER_SIZE + 12 * num_seq + 8 * (num_doc - 1))
        last_doc = struct.unpack("<q", f.read(8))[0]
    if first_doc != 0 or last_doc != num_seq:
        raise bad(f"document boundaries run {first_doc}..{last_doc}, expected 0..{num_seq}")
    if end != bin_size:
        raise ValueError(
            f"{bin_path} has {bin_size} bytes but {idx_path} describes {end}: the pair does "
            f"not belong together or one is truncated; {_RERUN}."
        )
    return IndexedFilesInfo(prefix, num_seq, num_doc - 1, bin_size // itemsize, dtype)
