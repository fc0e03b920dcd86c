"""Stochastic rounding's noise: 8 bits per element, 8 elements per Philox call.

k = one uniform byte (0..255) per element, from Philox-2x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011; known-answer vectors
checked in tests/quant/test_triton.py): one call gives two 32-bit words, 8
bytes, for a run of 8 consecutive elements of a group (columns 8j..8j+7, fewer
at its end). The counter is the run's first element's flat index (in the
padded layout: chunk c's element i of group g is (c * groups + g) * G + i), the
key the seed. Element 8j + i takes byte i % 4 of word i // 4 (little-endian:
byte 0 is the low byte). So an element's k depends only on (seed, its index,
the group size), never on how groups are spread over programs, sliced,
chunked or read (the rows op), and distinct runs use distinct counters.

The kernels compute k elementwise (``noise_byte``): the 8 elements of a run
have the same counter, and the compiler computes the call once for all of
them when they sit in one thread (8 or 32 consecutive elements a thread:
3.75 instructions per element for Philox's 10 rounds of 3), once per 4 when
four do (fp32 tiles of the generic path).

How k rounds: ``rounding.py``; why 8 bits suffice (the bias bound): there and
reference.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

RUN = tl.constexpr(8)  # elements served by one Philox-2x32 call (8 bytes)

_PHILOX_M = tl.constexpr(0xD256D193)  # Philox-2x32 round multiplier
_PHILOX_W = tl.constexpr(0x9E3779B9)  # key increment between rounds (golden ratio)


@triton.jit
def philox2x32(counter_lo, counter_hi, key):
    """Philox-2x32-10 of the counter (counter_lo, counter_hi) under ``key`` (uint32s)."""
    c0 = counter_lo
    c1 = counter_hi
    k = key
    for _ in tl.static_range(10):
        # One 32 x 32 -> 64-bit product gives both halves (one IMAD.WIDE; umulhi and
        # a separate low multiply compile to two multiplies).
        product = c0.to(tl.uint64) * _PHILOX_M
        c0 = (product >> 32).to(tl.uint32) ^ k ^ c1
        c1 = product.to(tl.uint32)
        k = k + _PHILOX_W
    return c0, c1


@triton.jit
def noise_byte(seed, run_start, col):
    """k in 0..255 (int32) of the element in column ``col`` of its group, whose run of
    8 starts at flat index ``run_start`` (int64; broadcast with ``col``).

    ``seed``: int64 scalar in [0, 2^31). Only col % 8 matters beyond ``run_start``.
    """
    start = run_start.to(tl.uint64, bitcast=True)
    w0, w1 = philox2x32((start & 0xFFFFFFFF).to(tl.uint32), (start >> 32).to(tl.uint32),
                        seed.to(tl.uint32))
    word = tl.where(col % 8 < 4, w0, w1)
    return ((word >> ((col % 4) * 8).to(tl.uint32)) & 0xFF).to(tl.int32)
