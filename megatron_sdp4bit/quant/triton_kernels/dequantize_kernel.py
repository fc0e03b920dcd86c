"""The one kernel that consumes quantized tensors: unpack, scale, sum chunks, write.

A program owns BLOCK consecutive output elements. For each it sums, in fp32 and
in chunk order 0..num_chunks-1, ``code * scale`` of that element in every chunk
(num_chunks = 1: plain dequantize), applies the inverse Hadamard transform in
registers when asked (``HADAMARD`` = block, 0 = none), then either stores the
result rounded to the output's dtype or, with ``ACCUMULATE``, adds it to the
output's current values in fp32 first and rounds once (``dequantize_add_``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_sdp4bit.quant.triton_kernels.code_runs import dequantized_run_sum
from megatron_sdp4bit.quant.triton_kernels.tile_math import (
    hadamard_flat,
    load_f32,
    store_f32,
)


@triton.jit
def dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr,
    numel, num_chunks, chunk_numel,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    HADAMARD: tl.constexpr, OUT_BF16: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """out[i] (+)= H^-1(sum_c dequant(chunk c)[i]) for i in [pid * BLOCK, ...) below numel."""
    pid = tl.program_id(0).to(tl.int64)
    elem = pid * BLOCK + tl.arange(0, BLOCK)
    ok = elem < numel
    # Codes exist up to numel rounded up to whole groups (the zero padding): reading
    # that far keeps the mask at a multiple of the group size (wide loads); the
    # elements past numel are not stored. The group count is int32-safe, its product
    # with GROUP is formed in int64 (numel may lie within a group of 2^31).
    padded = tl.cast((numel - 1) // GROUP + 1, tl.int64) * GROUP
    values = dequantized_run_sum(codes_ptr, scales_ptr, pid * BLOCK, padded - pid * BLOCK,
                                 num_chunks, chunk_numel, BLOCK, BITS, GROUP, BLOCK)
    if HADAMARD > 0:
        # numel and BLOCK are multiples of HADAMARD: every transform block is whole.
        # H^-1 = H / block, a multiplication by an exact power of two as in the reference.
        values = hadamard_flat(values, BLOCK, HADAMARD) * (1.0 / HADAMARD)
    if ACCUMULATE:
        values = values + load_f32(out_ptr, elem, ok, OUT_BF16)
    store_f32(out_ptr, elem, values, ok, OUT_BF16)
