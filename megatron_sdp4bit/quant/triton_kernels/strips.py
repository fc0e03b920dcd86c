"""Strips: 32 consecutive elements of a group in one thread's registers.

The quantize kernel's fast path (group size a multiple of 32) holds its tile as
[G, SPG, 32]: G groups of SPG = group size / 32 strips each, one strip a thread.
A strip is loaded and stored in 16-byte parts, each a [G, SPG, V] tensor whose
V elements lie in one thread (what Triton's coalescing gives such a load), and
joined in registers: a join puts its new dimension in the thread holding its
operands, and the permute and reshape that restore the element order move no
data. So everything done per strip (the Hadamard butterfly of 32, the absmax,
the noise of its 4 Philox runs, the packing of its codes) stays in the thread:
no shared memory, no barriers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_sdp4bit.quant.triton_kernels.tile_math import load_f32, store_f32

STRIP = tl.constexpr(32)


@triton.jit
def _part_offsets(base, valid, ok, FIRST: tl.constexpr, V: tl.constexpr, TAIL: tl.constexpr):
    """Offsets and mask of elements FIRST .. FIRST + V - 1 of every strip: [G, SPG, V]."""
    cols = FIRST + tl.arange(0, V)
    offsets = base[:, :, None] + cols[None, None, :]
    if TAIL:
        mask = cols[None, None, :] < valid[:, :, None]
    else:
        mask = ok[:, :, None] & (cols < STRIP)[None, None, :]  # constant along a strip
    return offsets, mask


@triton.jit
def _float_part(ptr, base, valid, ok, FIRST: tl.constexpr, V: tl.constexpr,
                IS_BF16: tl.constexpr, TAIL: tl.constexpr):
    """Elements FIRST .. FIRST + V - 1 of every strip (0 where masked), fp32."""
    offsets, mask = _part_offsets(base, valid, ok, FIRST, V, TAIL)
    return load_f32(ptr, offsets, mask, IS_BF16)


@triton.jit
def _bf16_word_part(ptr, base, valid, ok, FIRST: tl.constexpr, TAIL: tl.constexpr):
    """Elements FIRST .. FIRST + 7 of every strip of bf16 values read as four 32-bit
    words: [.., 4, 2] fp32, element 2j + i. The lower value of a word is w << 16,
    the upper w & 0xFFFF0000: one instruction each."""
    words = FIRST // 2 + tl.arange(0, 4)
    offsets = base[:, :, None] // 2 + words[None, None, :]
    if TAIL:
        mask = 2 * words[None, None, :] < valid[:, :, None]
    else:
        mask = ok[:, :, None] & (words < 16)[None, None, :]
    w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + offsets, mask=mask, other=0)
    low = (w << 16).to(tl.float32, bitcast=True)
    high = (w & -65536).to(tl.float32, bitcast=True)
    if TAIL:  # a word whose upper value lies past the end
        high = tl.where(2 * words[None, None, :] + 1 < valid[:, :, None], high, 0.0)
    return tl.join(low, high)


@triton.jit
def load_float_strips(ptr, base, valid, ok, IS_BF16: tl.constexpr, HALF: tl.constexpr,
                      TAIL: tl.constexpr, WORDS: tl.constexpr):
    """[G, SPG, 32] fp32: strip (g, s) is elements base[g, s] .. + 31 of ``ptr``.

    ``valid`` ([G, SPG] int32): elements of the strip before the end (TAIL);
    ``ok``: strips that exist. HALF: 2-byte elements (8 per 16-byte part, else 4);
    WORDS: bf16 read as 32-bit words of two (every base even, the pointer 4-byte aligned).
    """
    if WORDS:
        p0 = _bf16_word_part(ptr, base, valid, ok, 0, TAIL)
        p1 = _bf16_word_part(ptr, base, valid, ok, 8, TAIL)
        p2 = _bf16_word_part(ptr, base, valid, ok, 16, TAIL)
        p3 = _bf16_word_part(ptr, base, valid, ok, 24, TAIL)
        joined = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [.., word, i, j0, j1]
        ordered = tl.permute(joined, (0, 1, 5, 4, 2, 3))
    elif HALF:
        p0 = _float_part(ptr, base, valid, ok, 0, 8, IS_BF16, TAIL)
        p1 = _float_part(ptr, base, valid, ok, 8, 8, IS_BF16, TAIL)
        p2 = _float_part(ptr, base, valid, ok, 16, 8, IS_BF16, TAIL)
        p3 = _float_part(ptr, base, valid, ok, 24, 8, IS_BF16, TAIL)
        joined = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [.., r, j0, j1]: part j0 + 2 j1
        ordered = tl.permute(joined, (0, 1, 4, 3, 2))
    else:
        p0 = _float_part(ptr, base, valid, ok, 0, 4, IS_BF16, TAIL)
        p1 = _float_part(ptr, base, valid, ok, 4, 4, IS_BF16, TAIL)
        p2 = _float_part(ptr, base, valid, ok, 8, 4, IS_BF16, TAIL)
        p3 = _float_part(ptr, base, valid, ok, 12, 4, IS_BF16, TAIL)
        p4 = _float_part(ptr, base, valid, ok, 16, 4, IS_BF16, TAIL)
        p5 = _float_part(ptr, base, valid, ok, 20, 4, IS_BF16, TAIL)
        p6 = _float_part(ptr, base, valid, ok, 24, 4, IS_BF16, TAIL)
        p7 = _float_part(ptr, base, valid, ok, 28, 4, IS_BF16, TAIL)
        joined = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)),
                         tl.join(tl.join(p4, p5), tl.join(p6, p7)))  # [.., r, j0, j1, j2]
        ordered = tl.permute(joined, (0, 1, 5, 4, 3, 2))
    return tl.reshape(ordered, [base.shape[0], base.shape[1], 32])


@triton.jit
def _word_part(ptr, word_base, ok, FIRST: tl.constexpr, V: tl.constexpr):
    """Words FIRST .. FIRST + V - 1 of every strip's codes (int32, 0 where masked)."""
    cols = FIRST + tl.arange(0, V)
    mask = ok[:, :, None] & (cols < 64)[None, None, :]
    return tl.load(ptr.to(tl.pointer_type(tl.int32)) + word_base[:, :, None] + cols[None, None, :],
                   mask=mask, other=0)


@triton.jit
def _fields(flipped, zero, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """fp32 values of the BITS-bit codes at bit SHIFT (+ BITS <= 20) of every word,
    whose sign bits ``flipped`` holds inverted.

    The field, left where it is, becomes the low mantissa bits of the float
    2^(23 - SHIFT), whose spacing there is 1: the float is 2^(23 - SHIFT) + field
    exactly, and subtracting 2^(23 - SHIFT) + 2^(BITS - 1) (exact) leaves the
    two's-complement code. One mask-and-or, one add; no shift, no conversion.
    ``zero`` (a runtime 0) keeps the exponent bits in a register: with two
    immediates the mask and the or would be two instructions instead of one.
    """
    FIELD: tl.constexpr = ((1 << BITS) - 1) << SHIFT
    EXPONENT: tl.constexpr = (127 + 23 - SHIFT) << 23
    as_float = ((flipped & FIELD) | (EXPONENT + zero)).to(tl.float32, bitcast=True)
    return as_float - (2.0 ** (23 - SHIFT) + (1 << (BITS - 1)))


@triton.jit
def load_code_strips(codes_ptr, word_base, ok, zero, BITS: tl.constexpr):
    """[G, SPG, 32] fp32 code values (BITS 4 or 8) of the strips whose codes start at
    word ``word_base``.

    Codes are handled as 32-bit words only: a join puts its new dimension at the
    lowest register position, so joined values sit in a thread's registers out of
    element order; that is free for 32-bit values, but bytes would need a byte
    permute each. Field j of a word is element (word * fields per word) + j.
    """
    G: tl.constexpr = word_base.shape[0]
    SPG: tl.constexpr = word_base.shape[1]
    if BITS == 8:  # 8 words in two 16-byte parts, 4 fields a word
        words = tl.reshape(tl.permute(tl.join(_word_part(codes_ptr, word_base, ok, 0, 4),
                                              _word_part(codes_ptr, word_base, ok, 4, 4)),
                                      (0, 1, 3, 2)), [G, SPG, 8])
        flipped = words ^ -2139062144  # 0x80808080: every sign bit inverted
        upper = flipped >> 16  # fields 2 and 3 at bits 0 and 8
        quad = tl.join(tl.join(_fields(flipped, zero, 0, 8), _fields(flipped, zero, 8, 8)),
                       tl.join(_fields(upper, zero, 0, 8), _fields(upper, zero, 8, 8)))  # [.., w, j0, j1]
        values = tl.permute(quad, (0, 1, 2, 4, 3))
    else:  # 4 words, 8 fields a word
        flipped = _word_part(codes_ptr, word_base, ok, 0, 4) ^ -2004318072  # 0x88888888
        upper = flipped >> 16  # fields 4..7 at bits 0..12
        low = tl.join(tl.join(_fields(flipped, zero, 0, 4), _fields(flipped, zero, 4, 4)),
                      tl.join(_fields(flipped, zero, 8, 4), _fields(flipped, zero, 12, 4)))
        high = tl.join(tl.join(_fields(upper, zero, 0, 4), _fields(upper, zero, 4, 4)),
                       tl.join(_fields(upper, zero, 8, 4), _fields(upper, zero, 12, 4)))
        octet = tl.join(low, high)  # [.., w, j0, j1, j2]: field j0 + 2 j1 + 4 j2
        values = tl.permute(octet, (0, 1, 2, 5, 4, 3))
    return tl.reshape(values, [G, SPG, 32])


@triton.jit
def dequantized_strip_sum(codes_ptr, scales_ptr, codes_stride, scales_stride, first, ok, zero,
                          NUM_CHUNKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """[G, SPG, 32] fp32: sum over chunks 0..NUM_CHUNKS-1, in order, of code * scale of
    the strips whose first elements are ``first`` ([G, SPG] int64) in every chunk.

    GROUP is a multiple of 32: a strip lies in one group, one scale per strip and chunk.
    ``zero``: a runtime 0 (see ``_fields``).
    """
    PER_WORD: tl.constexpr = 32 // BITS
    total = tl.zeros([first.shape[0], first.shape[1], 32], dtype=tl.float32)
    for j in tl.static_range(NUM_CHUNKS):
        codes = load_code_strips(codes_ptr + j * codes_stride.to(tl.int64), first // PER_WORD,
                                 ok, zero, BITS)
        scale = tl.load(scales_ptr + j * scales_stride.to(tl.int64) + first // GROUP,
                        mask=ok, other=0.0)
        values = codes * scale[:, :, None]
        if j == 0:
            total = values
        else:
            total = total + values
    return total


@triton.jit
def _word_store(codes_ptr, word_base, ok, words, FIRST: tl.constexpr, V: tl.constexpr):
    cols = FIRST + tl.arange(0, V)
    mask = ok[:, :, None] & (cols < 64)[None, None, :]
    tl.store(codes_ptr.to(tl.pointer_type(tl.int32)) + word_base[:, :, None] + cols[None, None, :],
             words, mask=mask)


@triton.jit
def _placed(field, J: tl.constexpr, BITS: tl.constexpr):
    """Code of ``field`` (code in bits 8 and up) at field J of a word: one shift, one mask."""
    MASK: tl.constexpr = ((1 << BITS) - 1) << (BITS * J)
    if BITS * J >= 8:
        placed = field << (BITS * J - 8)
    else:
        placed = field >> (8 - BITS * J)
    if MASK >= 2**31:  # the top field: the mask as a signed 32-bit constant
        placed = placed & (MASK - 2**32)
    else:
        placed = placed & MASK
    return placed


@triton.jit
def _packed_words(t, keep, BITS: tl.constexpr):
    """[G, SPG, BITS] int32 words of the strips' codes (``t``: code in bits 8 and up),
    field j of word w = element (32 / BITS) w + j, masked by ``keep``."""
    G: tl.constexpr = t.shape[0]
    SPG: tl.constexpr = t.shape[1]
    if BITS == 8:
        even, odd = tl.split(tl.reshape(t, [G, SPG, 8, 2, 2]))  # [.., w, j1, j0]: j0 split off
        f0, f2 = tl.split(even)
        f1, f3 = tl.split(odd)
        words = (_placed(f0, 0, 8) | _placed(f1, 1, 8)) | (_placed(f2, 2, 8) | _placed(f3, 3, 8))
    else:
        even, odd = tl.split(tl.reshape(t, [G, SPG, 4, 2, 2, 2]))  # [.., w, j2, j1, j0]
        e0, e2 = tl.split(even)  # j0 = 0: fields 0, 4 (j1 = 0) and 2, 6 (j1 = 1)
        o0, o2 = tl.split(odd)
        f0, f4 = tl.split(e0)
        f2, f6 = tl.split(e2)
        f1, f5 = tl.split(o0)
        f3, f7 = tl.split(o2)
        words = (((_placed(f0, 0, 4) | _placed(f1, 1, 4)) | (_placed(f2, 2, 4) | _placed(f3, 3, 4)))
                 | ((_placed(f4, 4, 4) | _placed(f5, 5, 4)) | (_placed(f6, 6, 4) | _placed(f7, 7, 4))))
    return words & keep[:, :, None]


@triton.jit
def store_code_strips(codes_ptr, word_base, ok, keep, t, BITS: tl.constexpr):
    """Pack and store the strips' codes (BITS 4 or 8; ``t`` [G, SPG, 32]: code in bits 8
    and up) as 32-bit words from word ``word_base``; ``keep`` ([G, SPG] int32, -1 or
    0): 0 zeroes a strip's codes (unusable groups)."""
    words = _packed_words(t, keep, BITS)
    if BITS == 8:
        G: tl.constexpr = t.shape[0]
        SPG: tl.constexpr = t.shape[1]
        low, high = tl.split(tl.permute(tl.reshape(words, [G, SPG, 2, 4]), (0, 1, 3, 2)))
        _word_store(codes_ptr, word_base, ok, low, 0, 4)
        _word_store(codes_ptr, word_base, ok, high, 4, 4)
    else:
        _word_store(codes_ptr, word_base, ok, words, 0, 4)


@triton.jit
def _store_float_part(ptr, base, valid, ok, values, FIRST: tl.constexpr, V: tl.constexpr,
                      IS_BF16: tl.constexpr, TAIL: tl.constexpr):
    offsets, mask = _part_offsets(base, valid, ok, FIRST, V, TAIL)
    store_f32(ptr, offsets, values, mask, IS_BF16)


@triton.jit
def _store_four_parts(ptr, base, valid, ok, a, b, c, d, FIRST: tl.constexpr, V: tl.constexpr,
                      IS_BF16: tl.constexpr, TAIL: tl.constexpr):
    """Consecutive V-element parts a, b, c, d of every strip, the first at FIRST."""
    _store_float_part(ptr, base, valid, ok, a, FIRST, V, IS_BF16, TAIL)
    _store_float_part(ptr, base, valid, ok, b, FIRST + V, V, IS_BF16, TAIL)
    _store_float_part(ptr, base, valid, ok, c, FIRST + 2 * V, V, IS_BF16, TAIL)
    _store_float_part(ptr, base, valid, ok, d, FIRST + 3 * V, V, IS_BF16, TAIL)


@triton.jit
def store_float_strips(ptr, base, valid, ok, values, IS_BF16: tl.constexpr, HALF: tl.constexpr,
                       TAIL: tl.constexpr):
    """Store [G, SPG, 32] fp32 ``values`` (rounded to the pointer's dtype) as strips at
    ``base`` (the inverse of ``load_float_strips``), in 16-byte parts."""
    G: tl.constexpr = values.shape[0]
    SPG: tl.constexpr = values.shape[1]
    if HALF:  # 4 parts of 8: [.., j1, j0, r] -> split j0, then j1
        even, odd = tl.split(tl.permute(tl.reshape(values, [G, SPG, 2, 2, 8]), (0, 1, 4, 2, 3)))
        p0, p2 = tl.split(even)
        p1, p3 = tl.split(odd)
        _store_four_parts(ptr, base, valid, ok, p0, p1, p2, p3, 0, 8, IS_BF16, TAIL)
    else:  # 8 parts of 4: [.., j2, j1, j0, r]
        even, odd = tl.split(tl.permute(tl.reshape(values, [G, SPG, 2, 2, 2, 4]),
                                        (0, 1, 5, 2, 3, 4)))  # split j0
        e0, e1 = tl.split(even)  # j1 = 0 / 1: parts 0, 4 / 2, 6
        o0, o1 = tl.split(odd)  # parts 1, 5 / 3, 7
        p0, p4 = tl.split(e0)
        p2, p6 = tl.split(e1)
        p1, p5 = tl.split(o0)
        p3, p7 = tl.split(o1)
        _store_four_parts(ptr, base, valid, ok, p0, p1, p2, p3, 0, 4, IS_BF16, TAIL)
        _store_four_parts(ptr, base, valid, ok, p4, p5, p6, p7, 16, 4, IS_BF16, TAIL)
