"""Torch reference of every quantization op: the specification the kernels match.

Quantizer: symmetric, group-wise, one fp32 scale per group
``scale = absmax / (2^(b-1) - 1)`` (fp32 division); ``inv = 1 / scale`` when the
scale is finite and > 0 and its inverse finite, else 0 (the group is unusable);
``v = x * inv``; code = floor(v + 1/2) (``nearest``) or floor((rne(256 v) + k) / 256)
(``stochastic``, k a uniform random byte), clamped to ``[-2^(b-1), 2^(b-1) - 1]``
(in a usable group the codes lie in [-qmax, qmax] anyway). Every backend computes
these bit for bit. Runs on any device.

Stochastic rounding draws 8 random bits per element (k uniform in 0..255, eight
per 64-bit draw from the torch generator). v is first rounded to the grid of
1/256 (R = rne(256 v), round to nearest even; exact in fp32 arithmetic as
v + 1.5 * 2^15, see ``reference_stream.stochastic_codes_``), then
floor((R + k) / 256) is the code. Writing R = 256 a + b with 0 <= b < 256, the
code is a + 1 for the b values of k with b + k >= 256 and a otherwise, so
E[code] = a + b / 256 = R / 256 exactly, and the bias
|E[code] - v| = |R - 256 v| / 256 <= 2^-9 of a scale (STOCHASTIC_BIAS_BOUND, for
every bit width; attained where 256 v is an odd multiple of 1/2), far below the
rounding noise (standard deviation up to 1/2). Every code is floor(v) or
floor(v) + 1. tests/quant/test_reference.py checks the mean exactly over all 256 k.

Edge cases, by design:
- lengths that are not a multiple of the group size are zero-padded; the padding
  is stripped on dequantize;
- an all-zero group has scale 0 and dequantizes to exact zeros (no 0/0);
- a group holding NaN or Inf gets a non-finite scale and codes 0, so every element
  of that group dequantizes to NaN: overflow checks downstream still trip;
- a group so tiny that 1/scale overflows (absmax < qmax * 2^-128, subnormal
  values) is unusable: codes 0, so it dequantizes to zeros (an error below
  qmax * 2^-128 per element, like flushing subnormals to zero).

Chunks: every producer takes ``out=`` (a preallocated QuantizedTensor, flat or
k chunks, e.g. a ``wire.wire_view`` of a send buffer); with k chunks, chunk c
quantizes input elements [c*n, (c+1)*n) padded to whole groups on its own. The
consumers read either form: ``dequantize`` and ``dequantize_add_`` put chunk c
at [c*n, (c+1)*n); ``dequantize_sum*`` sum the chunks, adding chunk 0, then
1, ..., in fp32. How the work is streamed (cache-sized chunks, threads):
``reference_stream.py``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_sdp4bit.quant import reference_stream as S
from megatron_sdp4bit.quant.hadamard import butterfly, staging_buffer
from megatron_sdp4bit.quant.reference_stream import (
    NOISE_BITS,
    STOCHASTIC_BIAS_BOUND,
    Scratch,
    dequantize_groups_into,
    empty_quantized,
    flat_chunks,
    for_each_group_range,
    quantize_stream,
    read_fp32,
    sum_chunks_into,
)
from megatron_sdp4bit.quant.argument_contract import api_op
from megatron_sdp4bit.quant.types import QuantizedTensor

__all__ = [
    "quantize", "dequantize", "quantize_weight_diff", "dequantize_add_", "hadamard_quantize",
    "hadamard_quantize_rows", "dequantize_sum_requantize", "dequantize_sum",
    "NOISE_BITS", "STOCHASTIC_BIAS_BOUND", "stage_rows",
]


def _output(out: Optional[QuantizedTensor], numel: int, bits: int, group_size: int,
            dtype: torch.dtype, device: torch.device) -> QuantizedTensor:
    """``out`` (checked by the contract), or a new flat QuantizedTensor."""
    return empty_quantized(bits, group_size, numel, dtype, device) if out is None else out


@api_op()
def quantize(
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 2048,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
    out: Optional[QuantizedTensor] = None,
) -> QuantizedTensor:
    """Group-wise symmetric quantization of ``x`` (flattened), into ``out`` if given."""
    flat = x.reshape(-1)
    result = _output(out, flat.numel(), bits, group_size, x.dtype, x.device)
    return quantize_stream(lambda start, stop, limit, s: read_fp32(flat, start, stop, limit, s.work),
                           result, rounding, generator)


@api_op()
def dequantize(q: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Values of ``q`` as a flat tensor of ``q.numel`` elements in ``dtype`` (default q.dtype)."""
    out_dtype = dtype or q.dtype
    out = torch.empty(q.numel, dtype=out_dtype, device=q.device)
    if q.numel == 0:
        return out
    size, n = q.group_size, q.chunk_numel

    def body(c: int, chunk: QuantizedTensor, g0: int, g1: int, scratch: Scratch) -> None:
        start, stop = g0 * size, min(g1 * size, n)
        target = out[c * n + start: c * n + stop]
        direct = out_dtype == torch.float32 and stop == g1 * size
        values = dequantize_groups_into(chunk, g0, g1, target if direct else scratch.work,
                                        scratch.codes)
        if not direct:
            target.copy_(values[: stop - start])  # one rounding to out_dtype

    for_each_group_range(q, body)
    return out


# --- fused operations the collectives use ------------------------------------------

@api_op()
def quantize_weight_diff(
    main_shard: torch.Tensor,
    model_shard: torch.Tensor,
    bits: int = 4,
    group_size: int = 2048,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
    out: Optional[QuantizedTensor] = None,
) -> QuantizedTensor:
    """Quantize ``main_shard (fp32) - model_shard (bf16/fp32)``: the qWD payload."""
    main, model = main_shard.reshape(-1), model_shard.reshape(-1)
    result = _output(out, main.numel(), bits, group_size, torch.float32, main.device)

    def fill(start: int, stop: int, limit: int, scratch: Scratch) -> torch.Tensor:
        a = read_fp32(main, start, stop, limit, scratch.work)
        b = read_fp32(model, start, stop, limit, scratch.spare)
        return torch.sub(a, b, out=scratch.work[: stop - start])

    return quantize_stream(fill, result, rounding, generator)


@api_op()
def dequantize_add_(base: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``base += dequantize(q)`` in place, summed in fp32 and rounded once to base's dtype.

    ``base``: ``q.numel`` elements, or for k-chunk ``q`` also a [k, n] tensor
    (any row stride): chunk c is added into base[c] (= flat base[c*n:(c+1)*n]).
    """
    if q.numel == 0:
        return base
    n, size = q.chunk_numel, q.group_size
    rows = base if tuple(base.shape) == (q.num_chunks, n) else base.view(q.num_chunks, n)

    def body(c: int, chunk: QuantizedTensor, g0: int, g1: int, scratch: Scratch) -> None:
        start, stop = g0 * size, min(g1 * size, n)
        values = dequantize_groups_into(chunk, g0, g1, scratch.work, scratch.codes)[: stop - start]
        target = rows[c, start:stop]
        values.add_(read_fp32(target, 0, stop - start, stop - start, scratch.spare))
        target.copy_(values)

    for_each_group_range(q, body)
    return base


def _hadamard_fill(flat: torch.Tensor, block: Optional[int], scale: float) -> S.Fill:
    def fill(start: int, stop: int, limit: int, scratch: Scratch) -> torch.Tensor:
        n = stop - start
        dest, spare = scratch.work[:n], scratch.spare[:n]
        staging = dest if block is None else staging_buffer(dest, spare, block)
        values = read_fp32(flat, start, stop, limit, staging)
        if scale != 1.0:
            values = torch.mul(values, scale, out=staging)
        if block is None:
            return values
        return butterfly(values, dest, spare, block)

    return fill


@api_op()
def hadamard_quantize(
    x: torch.Tensor,
    bits: int = 8,
    group_size: int = 128,
    hadamard_block: Optional[int] = 32,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
    scale: float = 1.0,
    out: Optional[QuantizedTensor] = None,
) -> QuantizedTensor:
    """Quantize ``H(scale * x)`` (no transform when ``hadamard_block`` is None).

    ``scale`` folds the 1/DP of an averaging reduce-scatter into the same pass
    (fp32(x) * scale is rounded once, then transformed).
    ``x.numel()`` (each chunk of a k-chunk ``out``) must be a multiple of the block.
    """
    flat = x.reshape(-1)
    result = _output(out, flat.numel(), bits, group_size, x.dtype, x.device)
    return quantize_stream(_hadamard_fill(flat, hadamard_block, scale), result, rounding, generator)


def stage_rows(rows: torch.Tensor, order: Optional[torch.Tensor], start: int, valid: int,
               padded: int) -> torch.Tensor:
    """The staged tensor of ``hadamard_quantize_rows``: flat [P * padded] in rows' dtype,
    row r = rows[order[r], start:start + valid] followed by zeros up to ``padded``."""
    staged = rows.new_zeros(rows.shape[0], padded)
    piece = rows[:, start: start + valid]
    staged[:, :valid] = piece if order is None else piece.index_select(0, order)
    return staged.view(-1)


@api_op()
def hadamard_quantize_rows(
    rows: torch.Tensor,
    order: Optional[torch.Tensor],
    start: int,
    valid: int,
    padded: int,
    bits: int = 8,
    group_size: int = 128,
    hadamard_block: Optional[int] = 32,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
    scale: float = 1.0,
    out: Optional[QuantizedTensor] = None,
) -> QuantizedTensor:
    """``hadamard_quantize`` of the send-order staging of a pipeline chunk, without staging it.

    ``rows``: [P, shard] (the reduce-scatter's input viewed as P shards, each row
    contiguous). The quantized tensor has P * ``padded`` elements: row r holds
    columns [start, start + valid) of rows[order[r]] (``order``: a permutation as
    an integer tensor on rows' device; None = identity), then zeros up to
    ``padded`` (a multiple of the group size and of the Hadamard block). A
    k-chunk ``out`` must have chunks of whole groups. Defined as
    ``hadamard_quantize(stage_rows(...), ...)``, which is what this reference does.
    """
    staged = stage_rows(rows, order, start, valid, padded)
    return hadamard_quantize(staged, bits, group_size, hadamard_block, rounding, generator,
                             scale, out)


@api_op()
def dequantize_sum_requantize(
    q: QuantizedTensor,
    num_chunks: int,
    bits: int = 4,
    group_size: int = 128,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
    out: Optional[QuantizedTensor] = None,
) -> QuantizedTensor:
    """Dequantize k received chunks, sum them in fp32, quantize the sum again.

    The step between the two all-to-all hops; bits and group size may differ
    from the input's. ``q`` flat (k concatenated chunks) or k-chunk
    (``num_chunks`` = k); a k-chunk ``out`` must have chunks of whole groups of
    both formats.
    """
    chunk = q.numel // num_chunks
    result = _output(out, chunk, bits, group_size, q.dtype, q.device)
    sources = flat_chunks(q, num_chunks)

    def fill(start: int, stop: int, limit: int, scratch: Scratch) -> torch.Tensor:
        return sum_chunks_into(sources, start, stop, limit, scratch.work,
                               scratch.third(stop - start), scratch.codes)

    return quantize_stream(fill, result, rounding, generator, align=q.group_size)


@api_op()
def dequantize_sum(
    q: QuantizedTensor,
    num_chunks: int,
    inverse_hadamard_block: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dequantize k chunks, sum in fp32, then H^-1 per block if asked.

    ``q`` flat (k concatenated chunks) or k-chunk (``num_chunks`` = k).
    Returns fp32, or writes (cast) into ``out`` and returns it.
    """
    chunk = q.numel // num_chunks
    block = inverse_hadamard_block
    result = torch.empty(chunk, dtype=torch.float32, device=q.device) if out is None else out
    flat = result.view(-1)
    if chunk == 0:
        return result
    sources = flat_chunks(q, num_chunks)
    align = q.group_size if block is None else math.lcm(q.group_size, block)
    step = min(chunk, S.chunk_groups(q.device, align, -(-chunk // align)) * align)
    direct = flat.dtype == torch.float32

    def work(i: int, scratch: Scratch) -> None:
        start = i * step
        stop = min(start + step, chunk)
        n = stop - start
        dest = flat[start:stop] if direct else scratch.third(n)
        total = dest if block is None else staging_buffer(dest, scratch.spare[:n], block)
        sum_chunks_into(sources, start, stop, chunk, total, scratch.work, scratch.codes)
        if block is not None:
            butterfly(total, dest, scratch.spare[:n], block)
            dest.mul_(1.0 / block)  # a power of two: exact
        if not direct:
            flat[start:stop].copy_(dest)

    S.run_chunks(q.device, -(-chunk // step), step, work)
    return result
