"""Rounding to codes and codes back to fp32 with no float/int conversion instruction.

On sm_90 the conversions (F2I, I2F, FRND, F2F) issue at 16 per clock per SM,
1/8 of the fp32 rate, and bound a quantizer that uses one or two per element
below the memory bandwidth. Adding a "magic" power-of-two offset makes the fp32
adder do the rounding, and the integer sits in the low mantissa bits, read by a
bit cast. Exact while |x| < 2^22 (codes are at most 127 in magnitude), and made
only of round-to-nearest fp32 adds and integer operations, so Triton's CPU
interpreter computes the same bits as the GPU.

Codes are produced as ``t``: an int32 whose bits from 8 up are the code (two's
complement), so the packer shifts each field into place with one shift:
``(t >> 8) & 0xF`` is a 4-bit code, ``(t >> 4) & 0xF0`` the same code in the
high nibble.
"""
from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2^15: v + this lies in [2^15, 2^16), where fp32's spacing is 2^-8, so the
# sum rounds v to the nearest multiple of 1/256 (ties to even) and its bits minus
# the constant's are rne(256 v), for |v| < 2^14.
_GRID_MAGIC = tl.constexpr(49152.0)
_GRID_MAGIC_BITS = tl.constexpr(0x47400000)
# 1.5 * 2^23: y + this rounds y to the nearest integer (ties to even), |y| < 2^22.
_INT_MAGIC = tl.constexpr(12582912.0)
_INT_MAGIC_BITS = tl.constexpr(0x4B400000)
# 2^23: the fp32 with bits 0x4B000000 | n is 2^23 + n for 0 <= n < 2^23.
_FIELD_MAGIC = tl.constexpr(8388608.0)
_FIELD_MAGIC_BITS = tl.constexpr(0x4B000000)


@triton.jit
def stochastic_t(x, inv, k):
    """``t`` of floor((rne(256 x inv) + k) / 256): the stochastic code of v = x * inv
    (the exact product) with noise k in 0..255.

    One fused multiply-add, x * inv + 1.5 * 2^15, rounds the exact product once onto
    the 1/256 grid (an intended FMA: compile_check accepts exactly this one). E over
    k uniform of the code is rne(256 v) / 256 exactly, so its bias is at most 2^-9
    of a step (reference.py proves it; STOCHASTIC_BIAS_BOUND).
    """
    return tl.fma(x, inv, _GRID_MAGIC).to(tl.int32, bitcast=True) - _GRID_MAGIC_BITS + k


@triton.jit
def nearest_t(x, inv):
    """``t`` of floor(fl(fl(x * inv) + 1/2)), the reference's nearest rounding, exactly.

    s = y + 1.5 * 2^23 holds rne(y) in its low bits; rne(y) - 1 where it rounded up.
    """
    y = x * inv + 0.5  # two roundings (fusion is off), as the reference
    s = y + _INT_MAGIC
    rounded_up = (s - _INT_MAGIC) > y  # s - magic is rne(y) exactly
    code = s.to(tl.int32, bitcast=True) - _INT_MAGIC_BITS - rounded_up.to(tl.int32)
    return code << 8


@triton.jit
def code_to_f32(field, BITS: tl.constexpr):
    """fp32 value of a BITS-bit two's-complement code given as its unsigned field (int32)."""
    SIGN: tl.constexpr = 1 << (BITS - 1)
    as_float = ((field ^ SIGN) | _FIELD_MAGIC_BITS).to(tl.float32, bitcast=True)
    return as_float - (_FIELD_MAGIC + SIGN)
