"""Uniform noise for stochastic rounding: 16 bits per element, 4 elements per Philox call.

u = (k + 1/2) / 2^16 with k uniform in 0..2^16-1: the same grid of cell centres
as the torch reference (``reference.NOISE_BITS``), so the reference's proof of
its bias bound, ``STOCHASTIC_BIAS_BOUND``, holds for the kernels word for word
(it only assumes k uniform and one fp32 rounding of v + u).

The bits come from Philox-2x32-10 (Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3", SC 2011; known-answer vectors checked in tests/quant/test_triton.py):
two 32-bit words, i.e. four 16-bit values, per call. One call serves a run of
4 consecutive elements of one group (columns 4j..4j+3 of the group, fewer at
its end): its counter is the flat index of the run's first element, its key
the seed. So an element's noise depends only on (seed, its index, the group
size), never on how groups are spread over programs or sliced, and distinct
runs use distinct counters. Element 4j + i of a group takes half i % 2 (0 = low)
of word i // 2.

Why these choices (GPU cost per element, see docs/quant.md):
- ``tl.rand`` runs a whole Philox-4x32-10 call (~70 integer instructions) per
  element and keeps one of its four words: stochastic rounding was ~4x slower
  than rounding to nearest;
- runs of 4, not 8: an fp32 tile gives each thread 4 consecutive elements (one
  16-byte load). Eight values from one ``tl.randint4x`` call would span two
  threads and cost a layout conversion through shared memory; Philox-2x32 makes
  exactly the 64 bits a thread needs, at half the work of a 4x32 call, so the
  cost per element is the same as 8 values per 4x32 call.
"""
from __future__ import annotations

import triton
import triton.language as tl

RUN = tl.constexpr(4)  # elements served by one Philox-2x32 call (2 words x 2 halves)

_PHILOX_M = tl.constexpr(0xD256D193)  # Philox-2x32 round multiplier
_PHILOX_W = tl.constexpr(0x9E3779B9)  # key increment between rounds (golden ratio)


@triton.jit
def philox2x32(counter_lo, counter_hi, key):
    """Philox-2x32-10 of the counter (counter_lo, counter_hi) under ``key`` (uint32s)."""
    c0 = counter_lo
    c1 = counter_hi
    k = key
    for _ in tl.static_range(10):
        hi = tl.umulhi(c0, _PHILOX_M)
        lo = c0 * _PHILOX_M
        c0 = hi ^ k ^ c1
        c1 = lo
        k = k + _PHILOX_W
    return c0, c1


@triton.jit
def _cell_centre(mantissa_bits):
    """u = (k + 1/2) / 2^16, given k already shifted into mantissa bits 7..22.

    The float with exponent 0 and mantissa (2k + 1) << 6 is 1 + (2k + 1) / 2^17,
    exactly; subtracting 1 is exact too (Sterbenz), leaving the cell centre.
    Building the float from bits avoids an int-to-float conversion, which runs at
    a quarter of the fp32 rate.
    """
    return (mantissa_bits | 0x3F800040).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _halves(word):
    """The two 16-bit halves of a uint32 word as cell centres (low half first)."""
    low = _cell_centre((word << 7) & 0x7FFF80)
    high = _cell_centre((word >> 9) & 0x7FFF80)
    return low, high


@triton.jit
def uniform_noise(seed, run_start, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """[ROWS, BLOCK] tile of u in (0, 1); column c of row r belongs to run c // 4.

    ``run_start``: [ROWS, BLOCK // 4] int64, the flat element index of each run's
    first element (the Philox counter). ``seed``: int64 scalar in [0, 2^31).
    """
    start = run_start.to(tl.uint64, bitcast=True)
    w0, w1 = philox2x32((start & 0xFFFFFFFF).to(tl.uint32), (start >> 32).to(tl.uint32),
                        seed.to(tl.uint32))
    n0, n1 = _halves(w0)
    n2, n3 = _halves(w1)
    # join(join(n0, n2), join(n1, n3)) has a minor [2, 2] whose index (p, q) holds
    # n_{2p + q}: reshaped, element i of the run gets n_i. A join puts its new
    # dimension in one thread's registers: no data moves between threads.
    return tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), [ROWS, BLOCK])
