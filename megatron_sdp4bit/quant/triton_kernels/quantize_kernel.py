"""The one kernel that produces quantized tensors: load, (Hadamard,) absmax, round, pack.

A program owns GROUPS_PER_PROGRAM whole groups of one output chunk (grid axis 1:
the chunk; chunk c's codes and scales start ``c * codes_stride`` bytes and ``c *
scales_stride`` scales into the output, so flat and wire layouts alike). Three
paths: STRIPS (the groups as strips of 32 elements, one a thread, strips.py: the
fast path every real call of the collectives takes); otherwise a [groups, BLOCK]
tile when a group fits in registers (BLOCK >= GROUP), read once; or a larger
group read twice, BLOCK columns at a time: once for its absmax, once to quantize
(recomputing the values). All three round with rounding.py and the noise of
noise.py, so they give the same bits.

Output chunk c holds elements [c * numel, (c + 1) * numel) of the source, padded
to whole groups on its own. The source (``SOURCE``):
- ``SOURCE_TENSOR``: ``(x - y) * multiplier`` in fp32 (``y`` optional): plain
  quantize, the weight difference main - model, and the 1/DP pre-scaling;
- ``SOURCE_CHUNKS``: the fp32 sum of the NUM_CHUNKS dequantized chunks of a
  received all-to-all buffer (the fused dequantize-sum-requantize);
- ``SOURCE_ROWS``: the reduce-scatter's send-order staging, read in place: the
  staged tensor is P rows of ``groups_per_row`` groups; staged row r is columns
  [row_start, row_start + row_valid) of source row order[r] (row r without
  HAS_ORDER), zeros after. Each group lies in one staged row, so one address
  computation per group replaces the staging copy.
Then an optional Hadamard transform in registers (``HADAMARD`` = block, 0 = none).
"""
from __future__ import annotations

import triton
import triton.language as tl

from megatron_sdp4bit.quant.triton_kernels.code_runs import dequantized_run_sum
from megatron_sdp4bit.quant.triton_kernels.noise import noise_byte
from megatron_sdp4bit.quant.triton_kernels.rounding import nearest_t, stochastic_t
from megatron_sdp4bit.quant.triton_kernels.strips import (
    dequantized_strip_sum,
    load_float_strips,
    store_code_strips,
)
from megatron_sdp4bit.quant.triton_kernels.tile_math import (
    dequantized_chunk_sum,
    hadamard_flat,
    load_f32,
)

SOURCE_TENSOR = 0
SOURCE_CHUNKS = 1
SOURCE_ROWS = 2


@triton.jit
def _source_values(base, cols, mask, run_first, run_valid,
                   x_ptr, y_ptr, multiplier,
                   src_codes_ptr, src_scales_ptr, src_codes_stride, src_scales_stride,
                   SOURCE: tl.constexpr, X_BF16: tl.constexpr, HAS_Y: tl.constexpr,
                   Y_BF16: tl.constexpr, SCALED: tl.constexpr, SRC_BITS: tl.constexpr,
                   SRC_GROUP: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """fp32 values to quantize at source offsets ``base[:, None] + cols[None, :]`` (0 where masked).

    ``run_first`` and ``run_valid``: the tile's first source index and how many
    of its elements lie before the end of the output chunk, used when the tile
    is one contiguous run of received chunks (its rows are adjacent whole groups,
    or it has one row).
    """
    elem = base[:, None] + cols[None, :]
    if SOURCE == 1:  # SOURCE_CHUNKS
        # run_first is a multiple of GROUP (whole groups per program) or of
        # gcd(GROUP, BLOCK) (a slice of a group, BLOCK >= 256): for the divisors that
        # matter below (8 / SRC_BITS, 4, 16) both mean "GROUP is a multiple of them".
        ALIGN: tl.constexpr = GROUP
        if (BLOCK == GROUP or ROWS == 1) and ALIGN % (8 // SRC_BITS) == 0:
            run = dequantized_run_sum(src_codes_ptr, src_scales_ptr, src_codes_stride,
                                      src_scales_stride, run_first, run_valid, NUM_CHUNKS,
                                      ROWS * BLOCK, SRC_BITS, SRC_GROUP, ALIGN)
            values = tl.reshape(run, [ROWS, BLOCK])
        else:  # rows with masked columns between them, or odd alignment: per element
            values = dequantized_chunk_sum(src_codes_ptr, src_scales_ptr, src_codes_stride,
                                           src_scales_stride, elem, mask, NUM_CHUNKS,
                                           SRC_BITS, SRC_GROUP)
    else:  # SOURCE_TENSOR and SOURCE_ROWS: a float tensor at the given offsets
        values = load_f32(x_ptr, elem, mask, X_BF16)
        if HAS_Y:
            values = values - load_f32(y_ptr, elem, mask, Y_BF16)
        if SCALED:  # a multiplier of 1.0 would change nothing, NaN included: skipped
            values = values * multiplier
    return values


@triton.jit
def _load_mask(row_ok, row_len, cols, GROUP: tl.constexpr, BLOCK: tl.constexpr,
               TAIL: tl.constexpr):
    """Which [rows, cols] of the tile hold real elements (cols: columns within the group).

    Without a tail the mask is constant along each row, which lets the compiler
    give each thread long runs of a row (wide loads, more Hadamard stages in
    registers); with a tail one int32 comparison per element.
    """
    if TAIL:
        mask = cols[None, :] < row_len[:, None]
    else:
        mask = row_ok[:, None] & (cols < BLOCK)[None, :]  # all-true columns: folded away
        if BLOCK > GROUP:
            mask = mask & (cols < GROUP)[None, :]
    return mask


@triton.jit
def _transformed(values, ROWS: tl.constexpr, BLOCK: tl.constexpr, HADAMARD: tl.constexpr):
    """The [ROWS, BLOCK] tile, Hadamard-transformed per HADAMARD-block when asked.

    BLOCK and the group size are multiples of HADAMARD, so no transform block
    straddles two groups or mixes real values with the masked columns.
    """
    if HADAMARD > 0:
        flat = hadamard_flat(tl.reshape(values, [ROWS * BLOCK]), ROWS * BLOCK, HADAMARD)
        values = tl.reshape(flat, [ROWS, BLOCK])
    return values


@triton.jit
def _rounded(values, inv, cols, noise_base, seed_ptr, STOCHASTIC: tl.constexpr):
    """``t`` (code in bits 8 and up, rounding.py) of every ``values * inv``; ``cols``:
    each element's column in its group, ``noise_base``: the flat padded index of its
    group's first element (broadcast with values). The noise is keyed by the
    element's index (noise.py)."""
    if STOCHASTIC:
        run_start = noise_base + cols // 8 * 8
        t = stochastic_t(values, inv, noise_byte(tl.load(seed_ptr), run_start, cols))
    else:
        t = nearest_t(values, inv)
    return t


@triton.jit
def _store_codes(values, inv, keep, groups, noise_base, row_ok, first_col, codes_ptr, seed_ptr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Round ``values * inv`` to codes, pack and store columns first_col.. of each row
    (``groups``: the rows' group indices within the chunk; ``keep``: -1, or 0 for an
    unusable group, whose codes are 0)."""
    cols = first_col + tl.arange(0, BLOCK)
    t = _rounded(values, inv[:, None], cols[None, :], noise_base[:, None], seed_ptr, STOCHASTIC)
    if BITS == 8:
        elem = groups[:, None] * GROUP + cols[None, :]
        codes = ((t >> 8) & keep[:, None]).to(tl.int8)
        tl.store(codes_ptr + elem, codes, mask=row_ok[:, None] & (cols[None, :] < GROUP))
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        FIELD: tl.constexpr = (1 << BITS) - 1
        fields = tl.reshape(t, [ROWS, BLOCK // PER_BYTE, PER_BYTE])
        position = tl.arange(0, PER_BYTE) * BITS  # field i of a byte at bit BITS * i
        shifted = fields >> (8 - position)[None, None, :]
        masked = shifted & ((FIELD << position)[None, None, :] & keep[:, None, None])
        packed = tl.sum(masked, axis=2)  # disjoint bit fields: sum == or
        byte_cols = first_col // PER_BYTE + tl.arange(0, BLOCK // PER_BYTE)
        byte_idx = groups[:, None] * (GROUP // PER_BYTE) + byte_cols[None, :]
        byte_ok = row_ok[:, None] & (byte_cols[None, :] < GROUP // PER_BYTE)
        tl.store(codes_ptr + byte_idx, packed.to(tl.uint8), mask=byte_ok)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_absmax(values):
    """max |value| of each row, NaN when the row holds one.

    PTX's plain max returns the non-NaN operand; ``max.NaN`` keeps it, so one
    reduction gives the reference's rule (a NaN group gets a NaN scale) without
    a second reduction over an is-NaN flag.
    """
    return tl.reduce(tl.abs(values), 1, _max_keeping_nan)


@triton.jit
def _scale_of(absmax, BITS: tl.constexpr):
    """Per-row (scale, inverse, keep): the inverse is 0 and keep 0 (else -1) when the
    group is unusable: its scale is 0, NaN or Inf, or so small that 1/scale overflows."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))  # IEEE division
    positive = (scale > 0) & (scale < float("inf"))  # false for NaN too
    inv = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), tl.where(positive, scale, 1.0))
    usable = positive & (inv < float("inf"))
    return scale, tl.where(usable, inv, 0.0), tl.where(usable, -1, 0)


@triton.jit
def _row_sources(chunk, groups, row_ok, numel, num_groups,
                 order_ptr, row_stride, row_start, row_valid, groups_per_row,
                 SOURCE: tl.constexpr, HAS_ORDER: tl.constexpr, GROUP: tl.constexpr):
    """(source offset of each row's first element, its valid columns) for groups ``groups``
    of output chunk ``chunk``."""
    if SOURCE == 2:  # SOURCE_ROWS: the group's staged row and column, then its source row
        staged = chunk * num_groups + groups  # output chunks are whole groups
        row = staged // groups_per_row
        col0 = (staged - row * groups_per_row) * GROUP
        if HAS_ORDER:
            row = tl.load(order_ptr + row, mask=row_ok, other=0).to(tl.int64)
        base = row * row_stride + row_start + col0
        row_len = tl.where(row_ok, tl.minimum(tl.maximum(row_valid - col0, 0), GROUP), 0)
        row_len = row_len.to(tl.int32)
    else:
        base = chunk * numel + groups * GROUP
        # Valid columns: GROUP, fewer in the chunk's last (zero-padded) group when its
        # numel is not a multiple of GROUP (TAIL), none past its last group.
        row_len = tl.minimum(numel - groups * GROUP, GROUP).to(tl.int32)
    return base, row_len


# Not specialised on (one compiled variant for every value): the scale strides and
# the rows source's valid columns and row length in groups, whose divisibility the
# kernel never uses, and which differ from call to call of one collective.
@triton.jit(do_not_specialize=["src_scales_stride", "scales_stride", "row_valid",
                               "groups_per_row", "num_groups", "zero"])
def quantize_kernel(
    x_ptr, y_ptr, multiplier,
    src_codes_ptr, src_scales_ptr, src_codes_stride, src_scales_stride,
    order_ptr, row_stride, row_start, row_valid, groups_per_row,
    codes_ptr, scales_ptr, codes_stride, scales_stride, seed_ptr,
    numel, num_groups, zero,
    SOURCE: tl.constexpr, X_BF16: tl.constexpr, HAS_Y: tl.constexpr, Y_BF16: tl.constexpr,
    SCALED: tl.constexpr, TAIL: tl.constexpr, SRC_BITS: tl.constexpr, SRC_GROUP: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, HAS_ORDER: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
    BLOCK: tl.constexpr, HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr,
    STRIPS: tl.constexpr, X_HALF: tl.constexpr, Y_HALF: tl.constexpr, X_WORDS: tl.constexpr,
    Y_WORDS: tl.constexpr,
):
    """Quantize groups [pid * GROUPS_PER_PROGRAM, ...) of output chunk program_id(1).

    ``numel`` and ``num_groups``: elements and groups of one output chunk (beyond
    numel: zero padding); ``codes`` and ``scales`` as in QuantizedTensor. STRIPS:
    the strip path (strips.py; GROUP a power of two >= 32, HADAMARD <= 32, 2- or
    4-byte float sources, received groups a multiple of 32); X_HALF / Y_HALF:
    x / y have 2-byte elements; X_WORDS / Y_WORDS: bf16 x / y read as 32-bit words
    (strips.py; every strip starts at an even offset of a 4-byte aligned tensor).
    ``zero`` is always 0 (strips.py's ``_fields`` keeps constants in registers with it).
    """
    pid = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    codes_ptr += chunk * codes_stride
    scales_ptr += chunk * scales_stride
    groups = pid * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    row_ok = groups < num_groups
    base, row_len = _row_sources(chunk, groups, row_ok, numel, num_groups, order_ptr,
                                 row_stride, row_start, row_valid, groups_per_row,
                                 SOURCE, HAS_ORDER, GROUP)
    noise_base = (chunk * num_groups + groups) * GROUP  # the flat padded index
    cols = tl.arange(0, BLOCK)  # (the sliced path's columns)
    # A received chunk is whole groups of the source (triton_ops checks it), so
    # chunk_end // SRC_GROUP * SRC_GROUP is chunk_end itself; written so, it tells the
    # compiler the mask is group-aligned. Only SOURCE_CHUNKS reads run_first/run_valid.
    chunk_end = (chunk + 1) * (numel // SRC_GROUP * SRC_GROUP)

    if STRIPS:  # each thread holds whole strips of 32: no shared memory
        scale = _quantize_strips(chunk, groups, row_ok, base, row_len, noise_base, chunk_end,
                                 numel, zero, x_ptr, y_ptr, multiplier, src_codes_ptr, src_scales_ptr,
                                 src_codes_stride, src_scales_stride, codes_ptr, seed_ptr,
                                 SOURCE, X_BF16, X_HALF, X_WORDS, HAS_Y, Y_BF16, Y_HALF,
                                 Y_WORDS, SCALED, TAIL, SRC_BITS, SRC_GROUP, NUM_CHUNKS, BITS,
                                 GROUP, HADAMARD, STOCHASTIC)
    elif BLOCK >= GROUP:  # one pass: the whole group stays in registers
        scale = _quantize_tile(pid, chunk, groups, row_ok, base, row_len, noise_base, chunk_end,
                               numel, x_ptr, y_ptr, multiplier, src_codes_ptr, src_scales_ptr,
                               src_codes_stride, src_scales_stride, codes_ptr, seed_ptr, SOURCE,
                               X_BF16, HAS_Y, Y_BF16, SCALED, TAIL, SRC_BITS, SRC_GROUP,
                               NUM_CHUNKS, BITS, GROUP, GROUPS_PER_PROGRAM, BLOCK, HADAMARD,
                               STOCHASTIC)
    else:  # two passes over BLOCK-column slices (unrolled): the absmax, then the codes;
        # the second reads each slice again rather than hold the whole group
        absmax = tl.zeros([GROUPS_PER_PROGRAM], dtype=tl.float32)
        for codes_pass in tl.static_range(2):
            if codes_pass:
                scale, inv, keep = _scale_of(absmax, BITS)
            for first in range(0, GROUP, BLOCK):
                values = _slice_values(base, cols, first, row_ok, row_len, chunk, pid, numel,
                                       chunk_end, x_ptr, y_ptr, multiplier, src_codes_ptr,
                                       src_scales_ptr, src_codes_stride, src_scales_stride,
                                       SOURCE, X_BF16, HAS_Y, Y_BF16, SCALED, TAIL, SRC_BITS,
                                       SRC_GROUP, NUM_CHUNKS, GROUPS_PER_PROGRAM, BLOCK, GROUP,
                                       HADAMARD)
                if codes_pass:
                    _store_codes(values, inv, keep, groups, noise_base, row_ok, first, codes_ptr,
                                 seed_ptr, BITS, GROUP, GROUPS_PER_PROGRAM, BLOCK, STOCHASTIC)
                else:
                    absmax = _max_keeping_nan(absmax, _row_absmax(values))
    # Stored as a [ROWS, 1] column: a [ROWS] vector's store has a layout of its own,
    # which made the compiler convert the whole tile into a second layout for the
    # absmax reduction (one more round trip through shared memory).
    tl.store(scales_ptr + groups[:, None], scale[:, None], mask=row_ok[:, None])


@triton.jit
def _slice_values(base, cols, first, row_ok, row_len, chunk, pid, numel, chunk_end,
                  x_ptr, y_ptr, multiplier, src_codes_ptr, src_scales_ptr, src_codes_stride,
                  src_scales_stride, SOURCE: tl.constexpr, X_BF16: tl.constexpr,
                  HAS_Y: tl.constexpr, Y_BF16: tl.constexpr, SCALED: tl.constexpr,
                  TAIL: tl.constexpr, SRC_BITS: tl.constexpr, SRC_GROUP: tl.constexpr,
                  NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                  GROUP: tl.constexpr, HADAMARD: tl.constexpr):
    """Columns [first, first + BLOCK) of a sliced group (one group per program), transformed."""
    if TAIL:  # row_len <= GROUP (0 for rows past the end): bounds the group too
        load_ok = cols[None, :] < (row_len - first)[:, None]
    elif GROUP % BLOCK == 0:  # every slice is whole
        load_ok = row_ok[:, None] & (cols < BLOCK)[None, :]
    else:  # the last slice reaches past the group
        load_ok = row_ok[:, None] & (cols < GROUP - first)[None, :]
    run_first = chunk * numel + pid * GROUP + first
    # Up to the end of the chunk or of this group, whichever comes first (a last
    # slice may reach past the group: GROUP need not be a multiple of BLOCK).
    run_valid = tl.minimum(chunk_end - run_first, GROUP - first)
    values = _source_values(base + first, cols, load_ok, run_first, run_valid, x_ptr, y_ptr,
                            multiplier, src_codes_ptr, src_scales_ptr, src_codes_stride,
                            src_scales_stride, SOURCE, X_BF16, HAS_Y, Y_BF16, SCALED,
                            SRC_BITS, SRC_GROUP, NUM_CHUNKS, ROWS, BLOCK, GROUP)
    return _transformed(values, ROWS, BLOCK, HADAMARD)


@triton.jit
def _quantize_strips(chunk, groups, row_ok, base, row_len, noise_base, chunk_end, numel, zero,
                     x_ptr, y_ptr, multiplier, src_codes_ptr, src_scales_ptr, src_codes_stride,
                     src_scales_stride, codes_ptr, seed_ptr, SOURCE: tl.constexpr,
                     X_BF16: tl.constexpr, X_HALF: tl.constexpr, X_WORDS: tl.constexpr,
                     HAS_Y: tl.constexpr, Y_BF16: tl.constexpr, Y_HALF: tl.constexpr,
                     Y_WORDS: tl.constexpr, SCALED: tl.constexpr,
                     TAIL: tl.constexpr, SRC_BITS: tl.constexpr, SRC_GROUP: tl.constexpr,
                     NUM_CHUNKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The rows ``groups`` as [groups, GROUP / 32, 32] strips: load, transform, quantize,
    pack, store; returns the scales."""
    ROWS: tl.constexpr = groups.shape[0]
    SPG: tl.constexpr = GROUP // 32
    col0 = tl.arange(0, SPG) * 32  # each strip's first column in its group
    ok = row_ok[:, None] & (col0 < GROUP)[None, :]
    strip_base = base[:, None] + col0[None, :]
    valid = row_len[:, None] - col0[None, :]  # elements of the strip before the end (TAIL)
    if SOURCE == 1:  # SOURCE_CHUNKS: whole strips of whole received groups
        first = chunk * numel + groups[:, None] * GROUP + col0[None, :]
        values = dequantized_strip_sum(src_codes_ptr, src_scales_ptr, src_codes_stride,
                                       src_scales_stride, first, ok & (first < chunk_end),
                                       zero, NUM_CHUNKS, SRC_BITS, SRC_GROUP)
    else:
        values = load_float_strips(x_ptr, strip_base, valid, ok, X_BF16, X_HALF, TAIL, X_WORDS)
        if HAS_Y:
            values = values - load_float_strips(y_ptr, strip_base, valid, ok, Y_BF16, Y_HALF,
                                                TAIL, Y_WORDS)
        if SCALED:
            values = values * multiplier
    if HADAMARD > 0:  # in each thread's registers: HADAMARD divides the strip's 32
        flat = hadamard_flat(tl.reshape(values, [ROWS * SPG * 32]), ROWS * SPG * 32, HADAMARD)
        values = tl.reshape(flat, [ROWS, SPG, 32])
    absmax = tl.reduce(tl.reduce(tl.abs(values), 2, _max_keeping_nan), 1, _max_keeping_nan)
    scale, inv, keep = _scale_of(absmax, BITS)
    cols = col0[:, None] + tl.arange(0, 32)[None, :]  # [SPG, 32]: column in the group
    t = _rounded(values, inv[:, None, None], cols[None, :, :], noise_base[:, None, None],
                 seed_ptr, STOCHASTIC)
    word_base = (groups[:, None] * GROUP + col0[None, :]) // (32 // BITS)
    store_code_strips(codes_ptr, word_base, ok, tl.broadcast_to(keep[:, None], [ROWS, SPG]),
                      t, BITS)
    return scale


@triton.jit
def _quantize_tile(pid, chunk, groups, row_ok, base, row_len, noise_base, chunk_end, numel,
                   x_ptr, y_ptr, multiplier, src_codes_ptr, src_scales_ptr, src_codes_stride,
                   src_scales_stride, codes_ptr, seed_ptr, SOURCE: tl.constexpr,
                   X_BF16: tl.constexpr, HAS_Y: tl.constexpr, Y_BF16: tl.constexpr,
                   SCALED: tl.constexpr, TAIL: tl.constexpr, SRC_BITS: tl.constexpr,
                   SRC_GROUP: tl.constexpr, NUM_CHUNKS: tl.constexpr, BITS: tl.constexpr,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                   HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The generic one-pass path: the rows ``groups`` as a [ROWS, BLOCK] tile (BLOCK >=
    GROUP): load, transform, quantize, pack, store; returns the scales."""
    cols = tl.arange(0, BLOCK)
    load_ok = _load_mask(row_ok, row_len, cols, GROUP, BLOCK, TAIL)
    run_first = chunk * numel + pid * ROWS * GROUP
    run_valid = chunk_end - run_first
    if ROWS == 1:
        run_valid = tl.minimum(run_valid, GROUP)
    values = _source_values(base, cols, load_ok, run_first, run_valid, x_ptr, y_ptr,
                            multiplier, src_codes_ptr, src_scales_ptr, src_codes_stride,
                            src_scales_stride, SOURCE, X_BF16, HAS_Y, Y_BF16, SCALED,
                            SRC_BITS, SRC_GROUP, NUM_CHUNKS, ROWS, BLOCK, GROUP)
    values = _transformed(values, ROWS, BLOCK, HADAMARD)
    scale, inv, keep = _scale_of(_row_absmax(values), BITS)
    _store_codes(values, inv, keep, groups, noise_base, row_ok, 0, codes_ptr, seed_ptr,
                 BITS, GROUP, ROWS, BLOCK, STOCHASTIC)
    return scale
