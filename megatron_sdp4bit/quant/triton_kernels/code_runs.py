"""Dequantize a contiguous run of N elements: wide loads, one scale per 16 elements.

``tile_math.dequantize_elements`` handles any set of element indices, one byte
load and one scale load per element. When a program's elements are consecutive
(every dequantize launch, and the requantize launch whose output groups fill
its tile), this module reads them as consecutive bytes instead:

- the codes as N / (8 / bits) bytes, each unpacked into its 2 or 4 fields in
  registers (nested joins put field i of byte j at element j * (8 / bits) + i,
  the packing.py layout). The loads are masked at ``n_valid``; when the caller
  derives it from a length rounded to whole groups, the compiler knows it is a
  multiple of 16 and still issues 16-byte loads (with a mask at an arbitrary
  element it would load byte by byte);
- the scales once per run of R elements (R = 16, 4 or 1, the largest that
  divides the group size): a group never starts inside such a run.

The arithmetic is the same ``code * scale`` in fp32 as the reference, and the
chunk sum adds chunks 0, 1, ..., k-1 in that order, so results are bit-identical.
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_sdp4bit.quant.triton_kernels.rounding import code_to_f32


@triton.jit
def _field(byte, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """fp32 value of the two's-complement field of BITS bits at bit SHIFT of int32 ``byte``
    (no conversion instruction: rounding.code_to_f32)."""
    return code_to_f32((byte >> SHIFT) & ((1 << BITS) - 1), BITS)


@triton.jit
def _codes(codes_ptr, first, n_valid, N: tl.constexpr, BITS: tl.constexpr):
    """fp32 codes of elements first .. first + N - 1 (0 from n_valid on)."""
    if BITS == 8:
        idx = tl.arange(0, N)
        raw = tl.load(codes_ptr + first + idx, mask=idx < n_valid, other=0)
        codes = code_to_f32(raw.to(tl.uint8, bitcast=True).to(tl.int32), 8)
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        idx = tl.arange(0, N // PER_BYTE)
        base = codes_ptr + first // PER_BYTE  # first is a multiple of PER_BYTE
        byte = tl.load(base + idx, mask=idx < n_valid // PER_BYTE, other=0).to(tl.int32)
        if BITS == 4:
            pairs = tl.join(_field(byte, 0, 4), _field(byte, 4, 4))  # [.., i] = field i
            codes = tl.reshape(pairs, [N])
        else:  # 2 bits: [.., p, q] = field 2p + q
            low = tl.join(_field(byte, 0, 2), _field(byte, 4, 2))
            high = tl.join(_field(byte, 2, 2), _field(byte, 6, 2))
            codes = tl.reshape(tl.join(low, high), [N])
    return codes


@triton.jit
def _times_scales(codes, scales_ptr, first, n_valid, N: tl.constexpr, GROUP: tl.constexpr,
                  R: tl.constexpr):
    """codes * the scale of their group, one scale load per run of R elements.

    A run past n_valid gets scale 0. One that n_valid cuts keeps its scale for the
    masked elements (0 * scale, NaN for a NaN scale): callers either do not store
    those elements (dequantize) or cut only at group boundaries (requantize: the
    source length is a whole number of groups), so no such run exists there.
    """
    run_first = first + tl.arange(0, N // R) * R
    scale = tl.load(scales_ptr + run_first // GROUP, mask=run_first - first < n_valid, other=0.0)
    return tl.reshape(tl.reshape(codes, [N // R, R]) * scale[:, None], [N])


@triton.jit
def _run(codes_ptr, scales_ptr, first, n_valid, N: tl.constexpr, BITS: tl.constexpr,
         GROUP: tl.constexpr, ALIGN: tl.constexpr):
    codes = _codes(codes_ptr, first, n_valid, N, BITS)
    # R divides the group size, N and the run's alignment: no group starts inside a run.
    if GROUP % 16 == 0 and N % 16 == 0 and ALIGN % 16 == 0:
        values = _times_scales(codes, scales_ptr, first, n_valid, N, GROUP, 16)
    elif GROUP % 4 == 0 and N % 4 == 0 and ALIGN % 4 == 0:
        values = _times_scales(codes, scales_ptr, first, n_valid, N, GROUP, 4)
    else:
        values = _times_scales(codes, scales_ptr, first, n_valid, N, GROUP, 1)
    return values


@triton.jit
def dequantized_run_sum(codes_ptr, scales_ptr, codes_stride, scales_stride, first, n_valid,
                        NUM_CHUNKS: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
                        GROUP: tl.constexpr, ALIGN: tl.constexpr):
    """[N] fp32: sum over chunks 0..NUM_CHUNKS-1, in order, of code * scale of elements
    first .. first + N - 1 of each chunk; 0 from element ``n_valid`` of the run on.

    Chunk j's codes start ``j * codes_stride`` bytes and its scales ``j *
    scales_stride`` scales after chunk 0's. ``first`` (int64) is a multiple of
    ALIGN, which must be a multiple of 8 / BITS; a chunk starts on a group
    boundary; ``n_valid`` is a multiple of 8 / BITS.
    """
    total = _run(codes_ptr, scales_ptr, first, n_valid, N, BITS, GROUP, ALIGN)
    for j in tl.static_range(1, NUM_CHUNKS):  # unrolled: NUM_CHUNKS is a compile-time constant
        total += _run(codes_ptr + j * codes_stride.to(tl.int64),
                      scales_ptr + j * scales_stride.to(tl.int64),
                      first, n_valid, N, BITS, GROUP, ALIGN)
    return total
