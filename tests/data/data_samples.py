"""Shared by the data-pipeline tests: awkward sample documents and an
independent reader of Megatron's .bin/.idx files."""
import struct

import numpy

# Documents that stress a byte-level round trip: non-ASCII, emoji, CRLF, tabs,
# leading/trailing spaces, the GPT-2 EOD string appearing as plain text.
SAMPLE_DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.\nSecond line.",
    "  indented  text with\ttabs and trailing spaces   ",
    "Unicode: naïve café, Ελληνικά, 日本語, emoji 🚀🔥.",
    "windows\r\nline endings\r\n",
    "def f(x):\n    return x ** 2  # a comment\n",
    "This text mentions <|endoftext|> literally, which is not an EOD.",
    "short",
] + [f"Document number {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(40)]

_DTYPES = {1: numpy.uint8, 4: numpy.int32, 8: numpy.uint16}


def read_indexed(prefix):
    """Documents of PREFIX.bin/.idx, parsed from the documented byte layout with
    NumPy alone (independent of both our writer and megatron's reader)."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert version == 1
    lengths = numpy.frombuffer(raw, numpy.int32, n_seq, 34)
    pointers = numpy.frombuffer(raw, numpy.int64, n_seq, 34 + 4 * n_seq)
    boundaries = numpy.frombuffer(raw, numpy.int64, n_doc, 34 + 12 * n_seq)
    assert len(raw) == 34 + 12 * n_seq + 8 * n_doc
    dtype = _DTYPES[code]
    tokens = numpy.fromfile(prefix + ".bin", dtype=dtype)
    itemsize = numpy.dtype(dtype).itemsize
    assert numpy.array_equal(pointers, numpy.concatenate([[0], numpy.cumsum(lengths)[:-1]]) * itemsize)
    assert list(boundaries) == list(range(n_seq + 1)), "one sequence per document"
    return [tokens[p // itemsize: p // itemsize + n].astype(numpy.int64).tolist()
            for p, n in zip(pointers, lengths)], dtype
