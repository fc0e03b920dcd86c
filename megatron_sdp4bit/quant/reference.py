"""Torch reference of every quantization op: the specification the kernels match.

Quantizer: symmetric, group-wise, one fp32 scale per group
``scale = absmax / (2^(b-1) - 1)`` (fp32 division); ``inv = 1 / scale`` when the
scale is finite and > 0, else 0; ``v = x * inv``; code = floor(v + 1/2)
(``nearest``: one formula every backend computes bit for bit) or floor(v + u)
(``stochastic``), clamped to ``[-2^(b-1), 2^(b-1) - 1]``. Runs on any device.

Stochastic rounding draws u on a grid of 2^16 cell centres, u = (k + 1/2) / 2^16
with k uniform in 0..2^16-1 (16 random bits per element from the torch
generator, four per 64-bit draw; u is exact in fp32). Its bias, in units of the
group's scale: the grid alone gives |E[floor(v + u)] - v| <= 2^-17; the one
fp32 rounding of v + u (at most half an ulp of |v + u| < 2^(b-1) + 1) can move
v + u across an integer for at most one grid point (2- and 4-bit) or two
(8-bit, where |v + u| reaches 128 and the fp32 spacing is 2^-16), 2^-16 each.
So |E[code] - v| <= STOCHASTIC_BIAS_BOUND[bits]: 3 * 2^-17 ~ 2.3e-5 (2/4-bit),
5 * 2^-17 ~ 3.8e-5 (8-bit), far below the rounding noise (standard deviation
up to 1/2). tests/quant/test_reference.py checks it exactly over all 2^16 k.

Edge cases, by design:
- lengths that are not a multiple of the group size are zero-padded; the padding
  is stripped on dequantize;
- an all-zero group has scale 0 and dequantizes to exact zeros (no 0/0);
- a group holding NaN or Inf gets a non-finite scale and codes 0, so every element
  of that group dequantizes to NaN: overflow checks downstream still trip;
- a group so tiny that 1/scale overflows (absmax < ~1e-38) has inv = Inf: its
  non-zero elements get the extreme codes, its zeros (0 * Inf = NaN) code 0.

Speed (CPU): every op streams its input in chunks of 256 Ki to 1 Mi elements
(``_chunk_groups``), so the dozen elementwise steps of a chunk run on data still
in cache instead of re-reading memory each time. Chunks are spread over as many
worker threads as torch may use, each running its ops single-threaded (see
``_run_chunks``); random numbers are drawn in chunk order on the calling thread,
so results do not depend on the thread count. dtype conversions are separate
``copy_`` calls because torch's mixed-dtype arithmetic is several times slower
than same-dtype arithmetic. On other devices a chunk is the whole tensor.

Sums of received chunks (``dequantize_sum*``) add chunk 0, then 1, ..., in fp32.
"""
from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from megatron_sdp4bit.quant.hadamard import butterfly, staging_buffer
from megatron_sdp4bit.quant.packing import pack_codes_, unpack_codes_
from megatron_sdp4bit.quant.types import (
    QuantizedTensor,
    check_format,
    check_hadamard_block,
    check_hadamard_group,
    check_same_numel,
    codes_per_byte,
    num_groups,
    qmax,
)

# Elements per chunk on CPU, between these bounds: about 1/8 of the input, so
# there are chunks for every thread, but at least 256 Ki (per-op Python overhead
# is paid per chunk) and at most 1 Mi (4 MiB of fp32: the chunk's dozen passes
# stay in cache, and the scratch every chunk in flight owns stays small).
_CPU_MIN_CHUNK_ELEMENTS = 1 << 18
_CPU_CHUNK_ELEMENTS = 1 << 20

NOISE_BITS = 16
"""Random bits per element for stochastic rounding (the resolution of u)."""

STOCHASTIC_BIAS_BOUND = {2: 3 * 2.0**-17, 4: 3 * 2.0**-17, 8: 5 * 2.0**-17}
"""Largest |E[code] - v| of stochastic rounding, in units of the group's scale."""

_NOISE_STEP = 2.0 ** -NOISE_BITS
_NOISE_OFFSET = 0.5 + 2.0 ** -(NOISE_BITS + 1)  # k in [-2^15, 2^15) -> cell centre of [0, 1)


# --- scratch space and chunking --------------------------------------------------

class _Scratch:
    """The chunk-sized buffers one chunk in flight works in."""

    def __init__(self, elements: int, device: torch.device, noise: bool = False):
        self.work = torch.empty(elements, dtype=torch.float32, device=device)
        # spare: staging and ping-pong inside fill(), then the chunk's uniforms.
        self.spare = torch.empty(elements, dtype=torch.float32, device=device)
        self.extra = None  # a third fp32 buffer, made on demand
        self.codes = torch.empty(elements, dtype=torch.int8, device=device)
        self.noise = _NoiseBuffer(elements, device) if noise else None

    def third(self, elements: int) -> torch.Tensor:
        if self.extra is None:
            self.extra = torch.empty_like(self.work)
        return self.extra[:elements]


@contextlib.contextmanager
def _one_intra_op_thread(device: torch.device):
    """Run the calling thread's torch ops on that thread alone (CPU); restore on exit.

    Why: a chunk takes a dozen small ops. With several intra-op threads each op
    is an OpenMP parallel region whose barrier waits for all of them, and on a
    shared or oversubscribed machine one descheduled thread stalls the op for a
    scheduler time slice: measured 3-6x slower than one thread under load. The
    parallelism comes from whole chunks instead (``_run_chunks``). With torch's
    OpenMP backend the thread count belongs to the calling thread, so other
    threads keep theirs (threads *started* inside the window begin with one).
    """
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_chunks(
    device: torch.device,
    count: int,
    elements: int,
    work: Callable[[int, _Scratch], None],
    draw: Optional[Callable[[int, _Scratch], None]] = None,
) -> None:
    """Run ``work(i, scratch)`` for the chunks i = 0 .. count-1 (``elements`` at most each).

    On CPU, when torch may use T > 1 threads, T worker threads take the chunks,
    each running its ops single-threaded, and the calling thread runs
    ``draw(i, scratch)`` (random numbers, which must come from the generator in
    chunk order) just before handing chunk i out. Every chunk in flight owns a
    scratch, so the result does not depend on the threads. Otherwise the calling
    thread does it all, in chunk order.
    """
    workers = min(count, torch.get_num_threads()) if device.type == "cpu" else 1
    with _one_intra_op_thread(device):
        if workers <= 1:
            scratch = _Scratch(elements, device, noise=draw is not None)
            for i in range(count):
                if draw is not None:
                    draw(i, scratch)
                work(i, scratch)
            return
        scratches = [_Scratch(elements, device, noise=draw is not None) for _ in range(workers + 1)]
        with ThreadPoolExecutor(workers, "sdp4bit-quant", torch.set_num_threads, (1,)) as pool:
            running = []
            for i in range(count):
                scratch = scratches[i % len(scratches)]
                if i >= len(scratches):
                    running[i - len(scratches)].result()  # that chunk is done with this scratch
                if draw is not None:
                    draw(i, scratch)
                running.append(pool.submit(work, i, scratch))
            for future in running:
                future.result()


def _chunk_groups(device: torch.device, group_size: int, total_groups: int, align: int = 1) -> int:
    """Groups per chunk: a multiple of ``align``, cache-sized on CPU, all groups elsewhere."""
    if device.type != "cpu":
        return max(total_groups, align)
    target = max(_CPU_MIN_CHUNK_ELEMENTS, total_groups * group_size // 8)
    return max(align, min(_CPU_CHUNK_ELEMENTS, target) // group_size // align * align)


def _read_fp32(flat: torch.Tensor, start: int, stop: int, staging: torch.Tensor) -> torch.Tensor:
    """Elements [start, stop) of ``flat`` as fp32, zero past its end.

    A view of ``flat`` when it is fp32 and the range is inside it; otherwise the
    values are converted into ``staging`` (which is returned).
    """
    n = flat.numel()
    if stop <= n and flat.dtype == torch.float32:
        return flat[start:stop]
    have = max(0, min(stop, n) - start)
    out = staging[: stop - start]
    out[:have].copy_(flat[start:start + have])
    out[have:].zero_()
    return out


# --- the quantizer ---------------------------------------------------------------

def _cell_centres_(k: torch.Tensor) -> torch.Tensor:
    """Integers k in [-2^15, 2^15) (fp32) -> u = (k + 2^15 + 1/2) / 2^16, in place (exact).

    u is the centre of cell k + 2^15 of a 2^16-cell grid on [0, 1): uniform k
    gives u uniform on the cell centres, whose mean is exactly 1/2.
    """
    return k.mul_(_NOISE_STEP).add_(_NOISE_OFFSET)


class _NoiseBuffer:
    """One chunk's random bits, turned into uniforms u when the chunk needs them."""

    def __init__(self, elements: int, device: torch.device):
        self.words = torch.empty(-(-elements * NOISE_BITS // 64), dtype=torch.int64, device=device)

    def draw(self, elements: int, generator: Optional[torch.Generator]) -> None:
        """Draw the bits of ``elements`` uniforms (the serial part: call in chunk order)."""
        words = self.words[: -(-elements * NOISE_BITS // 64)]
        words.random_(-(2**63), None, generator=generator)  # all 64 bits random

    def uniforms(self, out: torch.Tensor) -> torch.Tensor:
        """The first ``out.numel()`` uniforms of the last draw, into fp32 ``out`` (any thread)."""
        out.copy_(self.words.view(torch.int16)[: out.numel()])
        return _cell_centres_(out)


def _round_(scaled: torch.Tensor, uniforms: Optional[torch.Tensor]) -> torch.Tensor:
    """floor(v + 1/2) (``uniforms`` None) or floor(v + u) in place; returns ``scaled``."""
    if uniforms is None:
        return scaled.add_(0.5).floor_()
    return scaled.add_(uniforms).floor_()


def _quantize_chunk(
    src: torch.Tensor,
    scales_out: torch.Tensor,
    codes_out: torch.Tensor,
    bits: int,
    levels_divisor: torch.Tensor,
    uniforms: Optional[torch.Tensor],
    scratch: _Scratch,
) -> None:
    """Quantize fp32 ``src`` [groups, group_size] into ``scales_out`` and ``codes_out``.

    ``levels_divisor`` holds qmax(bits) once per group: the scale divides by a
    tensor, because torch on CUDA turns division by a Python scalar into
    multiplication by its reciprocal, which is not the contract. ``uniforms``
    (flat, one per element) selects stochastic rounding. ``src`` may be
    ``scratch.work`` itself (it is then consumed).
    """
    levels = qmax(bits)
    torch.amax(src, dim=1, out=scales_out)
    # absmax = max(max, -min): two read-only reductions beat abs() + amax.
    torch.maximum(scales_out, torch.amin(src, dim=1).neg_(), out=scales_out)  # NaN propagates
    scales_out.div_(levels_divisor)
    # inv = 1/scale for a finite scale > 0, else 0 (NaN > 0 is false; 1/Inf is 0).
    inv = torch.where(scales_out > 0, scales_out.reciprocal(), 0.0)
    work = scratch.work[: src.numel()].view(src.shape)
    torch.mul(src, inv.unsqueeze(1), out=work)
    _round_(work, None if uniforms is None else uniforms.view(src.shape))
    codes = scratch.codes[: src.numel()]
    # scale * inv is 1 (0 for a zero group) in an ordinary group and NaN or Inf
    # in one holding NaN/Inf (inv 0) or whose 1/scale overflowed: one dot finds them.
    if not math.isfinite(float(torch.dot(scales_out, inv))):
        # Rare: NaN/Inf groups get codes 0; where 1/scale overflowed, x * Inf is
        # +-Inf (clamped to the extreme codes) or NaN for x = 0 (code 0).
        work.clamp_(-levels - 1, levels).nan_to_num_(nan=0.0)
        work.masked_fill_(~torch.isfinite(scales_out).unsqueeze(1), 0.0)
    elif bits == 8:
        # |v| may exceed 127 by a few ulps, and floor(v + u) reach 128: clamp
        # before the int8 conversion, which would wrap.
        work.clamp_(-levels - 1, levels)
    codes.copy_(work.view(-1))
    # 2/4-bit: |v| <= levels * (1 + 3 * 2^-24), so the floors lie in
    # [-levels - 1, levels + 1], well inside int8; clamp the bytes, 4x less data.
    codes.clamp_(-levels - 1, levels)
    pack_codes_(codes, bits, codes_out)


def _quantize_stream(
    numel: int,
    fill: Callable[[int, int, _Scratch], torch.Tensor],
    bits: int,
    group_size: int,
    rounding: str,
    generator: Optional[torch.Generator],
    device: torch.device,
    dtype: torch.dtype,
    align: int = 1,
) -> QuantizedTensor:
    """Quantize the ``numel`` values that ``fill(start, stop, scratch)`` yields chunk by chunk.

    ``fill`` returns elements [start, stop) as fp32 (zero past ``numel``), either
    a view of the caller's data or a buffer of ``scratch``; ``start``/``stop``
    are multiples of ``group_size`` and of ``align`` (``stop`` may be the padded end).
    """
    groups = num_groups(numel, group_size)
    width = codes_per_byte(bits)
    codes = torch.empty(
        QuantizedTensor.codes_nbytes(numel, bits, group_size),
        dtype=torch.int8 if bits == 8 else torch.uint8,
        device=device,
    )
    scales = torch.empty(groups, dtype=torch.float32, device=device)
    result = QuantizedTensor(codes=codes, scales=scales, bits=bits, group_size=group_size,
                             numel=numel, dtype=dtype)
    if groups == 0:
        return result
    step = min(groups, _chunk_groups(device, group_size, groups,
                                     align // math.gcd(align, group_size)))
    bounds = [(g0, min(g0 + step, groups)) for g0 in range(0, groups, step)]
    divisor = torch.full((step,), float(qmax(bits)), device=device)

    stochastic = rounding == "stochastic"

    def draw(i: int, scratch: _Scratch) -> None:
        g0, g1 = bounds[i]
        scratch.noise.draw((g1 - g0) * group_size, generator)

    def work(i: int, scratch: _Scratch) -> None:
        g0, g1 = bounds[i]
        n = (g1 - g0) * group_size
        src = fill(g0 * group_size, g1 * group_size, scratch).view(g1 - g0, group_size)
        # fill() is done with scratch.spare (its result is never spare): the noise goes there.
        uniforms = scratch.noise.uniforms(scratch.spare[:n]) if stochastic else None
        _quantize_chunk(src, scales[g0:g1], codes[g0 * group_size // width: g1 * group_size // width],
                        bits, divisor[: g1 - g0], uniforms, scratch)

    _run_chunks(device, len(bounds), step * group_size, work, draw if stochastic else None)
    return result


def quantize(
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 2048,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
) -> QuantizedTensor:
    """Group-wise symmetric quantization of ``x`` (flattened)."""
    check_format(bits, group_size, rounding)
    flat = x.reshape(-1)
    return _quantize_stream(
        flat.numel(), lambda start, stop, s: _read_fp32(flat, start, stop, s.work),
        bits, group_size, rounding, generator, x.device, x.dtype,
    )


# --- the dequantizer -------------------------------------------------------------

def _dequantize_groups_into(
    q: QuantizedTensor, g0: int, g1: int, dest: torch.Tensor, codes: torch.Tensor
) -> torch.Tensor:
    """fp32 values of groups [g0, g1) of ``q`` (padding included) into ``dest``; returns it."""
    n = (g1 - g0) * q.group_size
    width = codes_per_byte(q.bits)
    codes = codes[:n]
    unpack_codes_(q.codes[g0 * q.group_size // width: g1 * q.group_size // width], q.bits, codes)
    dest = dest[:n]
    dest.copy_(codes)
    dest.view(g1 - g0, q.group_size).mul_(q.scales[g0:g1].unsqueeze(1))
    return dest


def _for_each_chunk(q: QuantizedTensor, body: Callable[[int, int, _Scratch], None]) -> None:
    """Call ``body(g0, g1, scratch)`` over cache-sized group ranges of ``q``."""
    step = min(q.num_groups, _chunk_groups(q.device, q.group_size, q.num_groups))
    bounds = [(g0, min(g0 + step, q.num_groups)) for g0 in range(0, q.num_groups, step)]
    _run_chunks(q.device, len(bounds), step * q.group_size,
                lambda i, scratch: body(*bounds[i], scratch))


def dequantize(q: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Values of ``q`` as a flat tensor of ``q.numel`` elements in ``dtype`` (default q.dtype)."""
    out_dtype = dtype or q.dtype
    out = torch.empty(q.numel, dtype=out_dtype, device=q.device)
    if q.numel == 0:
        return out
    size = q.group_size

    def body(g0: int, g1: int, scratch: _Scratch) -> None:
        start, stop = g0 * size, min(g1 * size, q.numel)
        direct = out_dtype == torch.float32 and stop == g1 * size
        dest = out[start:stop] if direct else scratch.work
        values = _dequantize_groups_into(q, g0, g1, dest, scratch.codes)
        if not direct:
            out[start:stop].copy_(values[: stop - start])  # one rounding to out_dtype

    _for_each_chunk(q, body)
    return out


# --- fused operations the collectives use ------------------------------------------

def quantize_weight_diff(
    main_shard: torch.Tensor,
    model_shard: torch.Tensor,
    bits: int = 4,
    group_size: int = 2048,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
) -> QuantizedTensor:
    """Quantize ``main_shard (fp32) - model_shard (bf16/fp32)``: the qWD payload."""
    check_format(bits, group_size, rounding)
    check_same_numel("main shard", main_shard, "model shard", model_shard.numel())
    main, model = main_shard.reshape(-1), model_shard.reshape(-1)

    def fill(start: int, stop: int, scratch: _Scratch) -> torch.Tensor:
        a = _read_fp32(main, start, stop, scratch.work)
        b = _read_fp32(model, start, stop, scratch.spare)
        return torch.sub(a, b, out=scratch.work[: stop - start])

    return _quantize_stream(main.numel(), fill, bits, group_size, rounding, generator,
                            main.device, torch.float32)


def dequantize_add_(base: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``base += dequantize(q)`` in place, summed in fp32 and rounded once to base's dtype."""
    check_same_numel("base", base, "the quantized tensor", q.numel)
    if q.numel == 0:
        return base
    flat = base.view(-1)
    size = q.group_size

    def body(g0: int, g1: int, scratch: _Scratch) -> None:
        start, stop = g0 * size, min(g1 * size, q.numel)
        values = _dequantize_groups_into(q, g0, g1, scratch.work, scratch.codes)[: stop - start]
        values.add_(_read_fp32(flat, start, stop, scratch.spare))
        flat[start:stop].copy_(values)

    _for_each_chunk(q, body)
    return base


def hadamard_quantize(
    x: torch.Tensor,
    bits: int = 8,
    group_size: int = 128,
    hadamard_block: Optional[int] = 32,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
    scale: float = 1.0,
) -> QuantizedTensor:
    """Quantize ``H(scale * x)`` (no transform when ``hadamard_block`` is None).

    ``scale`` folds the 1/DP of an averaging reduce-scatter into the same pass
    (fp32(x) * scale is rounded once, then transformed).
    ``x.numel()`` must be a multiple of the block when a block is given.
    """
    check_format(bits, group_size, rounding)
    if hadamard_block is not None:
        check_hadamard_group(group_size, hadamard_block)
        if x.numel() % hadamard_block:
            raise ValueError(
                f"{x.numel()} elements is not a multiple of the Hadamard block {hadamard_block}"
            )
    flat = x.reshape(-1)

    def fill(start: int, stop: int, scratch: _Scratch) -> torch.Tensor:
        n = stop - start
        dest, spare = scratch.work[:n], scratch.spare[:n]
        staging = dest if hadamard_block is None else staging_buffer(dest, spare, hadamard_block)
        values = _read_fp32(flat, start, stop, staging)
        if scale != 1.0:
            values = torch.mul(values, scale, out=staging)
        if hadamard_block is None:
            return values
        return butterfly(values, dest, spare, hadamard_block)

    return _quantize_stream(flat.numel(), fill, bits, group_size, rounding, generator,
                            x.device, x.dtype)


def _check_chunks(q: QuantizedTensor, num_chunks: int) -> int:
    """Elements per chunk of the ``num_chunks`` equal chunks ``q`` concatenates."""
    if num_chunks <= 0 or q.numel % num_chunks:
        raise ValueError(f"{q.numel} elements cannot be split into {num_chunks} equal chunks")
    chunk = q.numel // num_chunks
    if chunk % q.group_size:
        raise ValueError(
            f"chunk of {chunk} elements is not a multiple of group_size={q.group_size}; "
            "chunks must start on a group boundary"
        )
    return chunk


def _sum_chunks_into(
    q: QuantizedTensor, num_chunks: int, chunk: int, start: int, stop: int,
    dest: torch.Tensor, temp: torch.Tensor, codes: torch.Tensor,
) -> torch.Tensor:
    """dest[:stop-start] <- sum over c of elements [start, stop) of chunk c of ``q``.

    ``start`` is a multiple of ``q.group_size``; elements past ``chunk`` are 0.
    """
    size = q.group_size
    have = max(0, min(stop, chunk) - start)
    dest = dest[: stop - start]
    dest[have:].zero_()
    for c in range(num_chunks):
        g0 = (c * chunk + start) // size
        g1 = g0 + have // size
        if c == 0:
            _dequantize_groups_into(q, g0, g1, dest, codes)
        else:
            dest[:have].add_(_dequantize_groups_into(q, g0, g1, temp, codes))
    return dest


def dequantize_sum_requantize(
    q: QuantizedTensor,
    num_chunks: int,
    bits: int = 4,
    group_size: int = 128,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
) -> QuantizedTensor:
    """Dequantize k received chunks, sum them in fp32, quantize the sum again.

    The step between the two all-to-all hops; bits and group size may differ
    from the input's.
    """
    check_format(bits, group_size, rounding)
    chunk = _check_chunks(q, num_chunks)

    def fill(start: int, stop: int, scratch: _Scratch) -> torch.Tensor:
        return _sum_chunks_into(q, num_chunks, chunk, start, stop, scratch.work,
                                scratch.third(stop - start), scratch.codes)

    return _quantize_stream(chunk, fill, bits, group_size, rounding, generator, q.device,
                            q.dtype, align=q.group_size)


def dequantize_sum(
    q: QuantizedTensor,
    num_chunks: int,
    inverse_hadamard_block: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dequantize k chunks, sum in fp32, then H^-1 per block if asked.

    Returns fp32, or writes (cast) into ``out`` and returns it.
    """
    chunk = _check_chunks(q, num_chunks)
    block = inverse_hadamard_block
    if block is not None:
        check_hadamard_block(block)
        if chunk % block:
            raise ValueError(
                f"hadamard_transform: {chunk} elements is not a multiple of block={block}; "
                "pad the input to a multiple of the block"
            )
    if out is not None and out.numel() != chunk:
        raise ValueError(f"out has {out.numel()} elements, the sum has {chunk}")
    result = torch.empty(chunk, dtype=torch.float32, device=q.device) if out is None else out
    flat = result.view(-1)
    if chunk == 0:
        return result
    align = q.group_size if block is None else math.lcm(q.group_size, block)
    step = min(chunk, _chunk_groups(q.device, align, -(-chunk // align)) * align)
    direct = flat.dtype == torch.float32

    def work(i: int, scratch: _Scratch) -> None:
        start = i * step
        stop = min(start + step, chunk)
        n = stop - start
        dest = flat[start:stop] if direct else scratch.third(n)
        total = dest if block is None else staging_buffer(dest, scratch.spare[:n], block)
        _sum_chunks_into(q, num_chunks, chunk, start, stop, total, scratch.work, scratch.codes)
        if block is not None:
            butterfly(total, dest, scratch.spare[:n], block)
            dest.mul_(1.0 / block)  # a power of two: exact
        if not direct:
            flat[start:stop].copy_(dest)

    _run_chunks(q.device, -(-chunk // step), step, work)
    return result
