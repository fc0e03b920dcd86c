"""@triton.jit building blocks shared by the quantize and dequantize kernels.

Every helper computes exactly what the torch reference computes, operation for
operation in fp32, so results are bit-identical (the kernels are launched with
``enable_fp_fusion=False``: a fused multiply-add would round once where the
reference rounds twice).

bf16 is read and written through int16 views with explicit bit arithmetic:
the conversion is then round-to-nearest-even on the GPU *and* in Triton's CPU
interpreter, whose own fp32->bf16 cast truncates.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from megatron_sdp4bit.quant.triton_kernels.rounding import code_to_f32


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones read the variable
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# The kernels were built for the CPU interpreter, not compiled for a GPU. Fixed at
# decoration time, which is now: triton.jit reads TRITON_INTERPRET when it decorates.
INTERPRETED: bool = _interpreting()


@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bit patterns of bf16 values -> the exact fp32 values.

    Zero-extended, not sign-extended, before the shift: for the upper of two
    values sharing a 32-bit register that is one mask (x & 0xFFFF0000); a sign
    extension made the compiler extract and shift it back (two instructions).
    """
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> int16 bit patterns of bf16, round to nearest even (as torch does).

    Adding 0x7FFF plus the lowest kept bit and truncating rounds ties to even;
    a carry out of the mantissa correctly bumps the exponent (up to Inf). NaN
    becomes the canonical quiet NaN 0x7FC0 instead of a rounded payload.
    """
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    bits = tl.where(x != x, 0x7FC0, rounded)
    return bits.to(tl.int16)


@triton.jit
def load_f32(ptr, offsets, mask, IS_BF16: tl.constexpr):
    """Elements at ``offsets`` as fp32 (0 where masked). bf16 comes as an int16 view."""
    if IS_BF16:
        value = bf16_bits_to_f32(tl.load(ptr + offsets, mask=mask, other=0))
    else:
        value = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return value


@triton.jit
def store_f32(ptr, offsets, value, mask, IS_BF16: tl.constexpr):
    """Store fp32 ``value`` rounded to the pointer's dtype (bf16 via an int16 view)."""
    if IS_BF16:
        tl.store(ptr + offsets, f32_to_bf16_bits(value), mask=mask)
    else:
        tl.store(ptr + offsets, value, mask=mask)  # tl.store casts, round to nearest


@triton.jit
def _butterfly_stage(y, N: tl.constexpr, H: tl.constexpr):
    """One stage of the reference butterfly on a flat [N] tile.

    Element i and i + H of every 2H-sized sub-block become (a + b, a - b), the
    same two fp32 operations, on the same operands, as hadamard.py.
    """
    pairs = tl.permute(tl.reshape(y, [N // (2 * H), 2, H]), (0, 2, 1))  # [.., H, 2]
    a, b = tl.split(pairs)
    mixed = tl.join(a + b, a - b)  # [.., H, 2]
    return tl.reshape(tl.permute(mixed, (0, 2, 1)), [N])


@triton.jit
def hadamard_flat(y, N: tl.constexpr, BLOCK: tl.constexpr):
    """Unnormalised Walsh-Hadamard transform of each consecutive BLOCK of a flat [N] tile.

    Stages run in the reference's order (pair distance 1, 2, 4, ...), so the fp32
    result is bit-identical. BLOCK is a power of two between 2 and 256.
    """
    for stage in tl.static_range(8):  # unrolled at compile time: pair distances 1 .. 128
        if (2 << stage) <= BLOCK:
            y = _butterfly_stage(y, N, 1 << stage)
    return y


@triton.jit
def dequantize_elements(codes_ptr, scales_ptr, elem, mask, BITS: tl.constexpr, GROUP: tl.constexpr):
    """fp32 ``code * scale`` of the elements with flat indices ``elem`` (0 where masked).

    Codes are unpacked per element from their byte (the layout of packing.py:
    code i of a byte at bit offset i * BITS, two's complement); neighbouring
    elements read the same byte, which the cache serves.
    """
    if BITS == 8:
        raw = tl.load(codes_ptr + elem, mask=mask, other=0)
        code = code_to_f32(raw.to(tl.uint8, bitcast=True).to(tl.int32), 8)
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        FIELD: tl.constexpr = (1 << BITS) - 1
        byte = tl.load(codes_ptr + elem // PER_BYTE, mask=mask, other=0)
        byte = byte.to(tl.uint8, bitcast=True).to(tl.int32)
        code = code_to_f32((byte >> ((elem % PER_BYTE) * BITS).to(tl.int32)) & FIELD, BITS)
    scale = tl.load(scales_ptr + elem // GROUP, mask=mask, other=0.0)
    return code * scale


@triton.jit
def dequantized_chunk_sum(codes_ptr, scales_ptr, codes_stride, scales_stride, elem, mask,
                          NUM_CHUNKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """fp32 sum over chunks 0..NUM_CHUNKS-1 (in that order) of element ``elem`` of each
    chunk; chunk j's codes and scales lie ``j * codes_stride`` bytes and ``j *
    scales_stride`` scales after chunk 0's."""
    total = dequantize_elements(codes_ptr, scales_ptr, elem, mask, BITS, GROUP)
    for j in tl.static_range(1, NUM_CHUNKS):
        total += dequantize_elements(codes_ptr + j * codes_stride.to(tl.int64),
                                     scales_ptr + j * scales_stride.to(tl.int64),
                                     elem, mask, BITS, GROUP)
    return total
