"""The one kernel that consumes quantized tensors: unpack, scale, sum chunks, write.

A program owns BLOCK consecutive output elements of one output chunk (grid axis
1: the chunk, for ``dequantize`` / ``dequantize_add_`` of a k-chunk tensor; one
chunk otherwise). For each it sums, in fp32 and in chunk order
0..NUM_CHUNKS-1, ``code * scale`` of that element in every summed chunk
(NUM_CHUNKS = 1: plain dequantize), applies the inverse Hadamard transform in
registers when asked (``HADAMARD`` = block, 0 = none), then either stores the
result rounded to the output's dtype or, with ``ACCUMULATE``, adds it to the
output's current values in fp32 first and rounds once (``dequantize_add_``).

Chunk c (summed or written) reads its codes ``c * codes_stride`` bytes and its
scales ``c * scales_stride`` scales after chunk 0's: the flat layout (k
concatenated chunks) and the wire layout (one segment per chunk) alike.
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_sdp4bit.quant.triton_kernels.code_runs import dequantized_run_sum
from megatron_sdp4bit.quant.triton_kernels.strips import (
    dequantized_strip_sum,
    load_float_strips,
    store_float_strips,
)
from megatron_sdp4bit.quant.triton_kernels.tile_math import (
    hadamard_flat,
    load_f32,
    store_f32,
)


# The scale stride's divisibility buys nothing (one scale load per 16 elements)
# and differs between layouts: not specialised on, so one compiled variant serves all.
@triton.jit(do_not_specialize=["scales_stride", "zero"])
def dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr,
    numel, codes_stride, scales_stride, out_stride, zero,
    NUM_CHUNKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    HADAMARD: tl.constexpr, OUT_BF16: tl.constexpr, ACCUMULATE: tl.constexpr,
    STRIPS: tl.constexpr, OUT_HALF: tl.constexpr, OUT_WORDS: tl.constexpr, TAIL: tl.constexpr,
):
    """out[c][i] (+)= H^-1(sum_j dequant(chunk c + j)[i]) for i in [pid * BLOCK, ...) below numel.

    ``numel``: elements of one chunk; output chunk c starts ``c * out_stride``
    elements into ``out``. STRIPS: the strip path (strips.py; 4- or 8-bit codes in
    aligned words, groups of whole strips, HADAMARD <= 32), OUT_HALF: 2-byte
    output elements, OUT_WORDS: a bf16 output read in 32-bit words (accumulate),
    TAIL: numel is not a multiple of 32. ``zero`` is always 0 (strips.py's ``_fields``
    keeps constants in registers with it).
    """
    pid = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    codes_ptr += chunk * codes_stride
    scales_ptr += chunk * scales_stride
    out_ptr += chunk * out_stride
    if STRIPS:
        _dequantize_strips(pid, codes_ptr, scales_ptr, out_ptr, numel, codes_stride,
                           scales_stride, zero, NUM_CHUNKS, BITS, GROUP, BLOCK, HADAMARD, OUT_BF16,
                           ACCUMULATE, OUT_HALF, OUT_WORDS, TAIL)
    else:
        _dequantize_runs(pid, codes_ptr, scales_ptr, out_ptr, numel, codes_stride,
                         scales_stride, NUM_CHUNKS, BITS, GROUP, BLOCK, HADAMARD, OUT_BF16,
                         ACCUMULATE)


@triton.jit
def _dequantize_strips(pid, codes_ptr, scales_ptr, out_ptr, numel, codes_stride, scales_stride,
                       zero, NUM_CHUNKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK: tl.constexpr, HADAMARD: tl.constexpr, OUT_BF16: tl.constexpr,
                       ACCUMULATE: tl.constexpr, OUT_HALF: tl.constexpr,
                       OUT_WORDS: tl.constexpr, TAIL: tl.constexpr):
    """The program's BLOCK elements as [1, BLOCK / 32, 32] strips, one a thread."""
    S: tl.constexpr = BLOCK // 32
    first = (pid * BLOCK + tl.arange(0, S) * 32)[None, :]  # [1, S] int64
    # Codes exist up to numel rounded up to whole groups (their zero padding).
    padded = tl.cast((numel - 1) // GROUP + 1, tl.int64) * GROUP
    values = dequantized_strip_sum(codes_ptr, scales_ptr, codes_stride, scales_stride, first,
                                   first < padded, zero, NUM_CHUNKS, BITS, GROUP)
    if HADAMARD > 0:  # whole transform blocks in each thread; H^-1 = H / block (exact)
        flat = hadamard_flat(tl.reshape(values, [BLOCK]), BLOCK, HADAMARD) * (1.0 / HADAMARD)
        values = tl.reshape(flat, [1, S, 32])
    # Elements of the strip before numel (TAIL), clamped to a strip before the int32
    # cast: unclamped, a chunk of 2^31 or more elements wrapped it negative and its
    # strips were silently not stored.
    valid = tl.minimum(numel - first, 32).to(tl.int32)
    ok = first < numel
    if ACCUMULATE:
        values = values + load_float_strips(out_ptr, first, valid, ok, OUT_BF16, OUT_HALF,
                                            TAIL, OUT_WORDS)
    store_float_strips(out_ptr, first, valid, ok, values, OUT_BF16, OUT_HALF, TAIL)


@triton.jit
def _dequantize_runs(pid, codes_ptr, scales_ptr, out_ptr, numel, codes_stride, scales_stride,
                     NUM_CHUNKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK: tl.constexpr, HADAMARD: tl.constexpr, OUT_BF16: tl.constexpr,
                     ACCUMULATE: tl.constexpr):
    """The program's BLOCK elements as one run (code_runs.py): any group size and bits."""
    elem = pid * BLOCK + tl.arange(0, BLOCK)
    ok = elem < numel
    # Codes exist up to numel rounded up to whole groups (the zero padding): reading
    # that far keeps the mask at a multiple of the group size (wide loads); the
    # elements past numel are not stored. The group count is int32-safe, its product
    # with GROUP is formed in int64 (numel may lie within a group of 2^31).
    padded = tl.cast((numel - 1) // GROUP + 1, tl.int64) * GROUP
    values = dequantized_run_sum(codes_ptr, scales_ptr, codes_stride, scales_stride,
                                 pid * BLOCK, padded - pid * BLOCK,
                                 NUM_CHUNKS, BLOCK, BITS, GROUP, BLOCK)
    if HADAMARD > 0:
        # numel and BLOCK are multiples of HADAMARD: every transform block is whole.
        # H^-1 = H / block, a multiplication by an exact power of two as in the reference.
        values = hadamard_flat(values, BLOCK, HADAMARD) * (1.0 / HADAMARD)
    if ACCUMULATE:
        values = values + load_f32(out_ptr, elem, ok, OUT_BF16)
    store_f32(out_ptr, elem, values, ok, OUT_BF16)
