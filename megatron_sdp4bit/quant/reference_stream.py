"""How the torch reference streams a tensor: cache-sized chunks, worker threads, noise.

Every reference op streams its input in chunks of 256 Ki to 1 Mi elements
(``chunk_groups``), so the dozen elementwise steps of a chunk run on data still
in cache instead of re-reading memory each time. Chunks are spread over as many
worker threads as torch may use, each running its ops single-threaded (see
``run_chunks``); random numbers are drawn in chunk order on the calling thread,
so results do not depend on the thread count. dtype conversions are separate
``copy_`` calls because torch's mixed-dtype arithmetic is several times slower
than same-dtype arithmetic. On other devices a chunk is the whole tensor.

The quantizer's arithmetic (``quantize_chunk``) and its stochastic-rounding
noise are defined here; ``reference.py`` states the contract they implement.
"""
from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from megatron_sdp4bit.quant.packing import pack_codes_, unpack_codes_
from megatron_sdp4bit.quant.types import QuantizedTensor, codes_per_byte, num_groups, qmax

# Elements per chunk on CPU, between these bounds: about 1/8 of the input, so
# there are chunks for every thread, but at least 256 Ki (per-op Python overhead
# is paid per chunk) and at most 1 Mi (4 MiB of fp32: the chunk's dozen passes
# stay in cache, and the scratch every chunk in flight owns stays small).
CPU_MIN_CHUNK_ELEMENTS = 1 << 18
CPU_CHUNK_ELEMENTS = 1 << 20

NOISE_BITS = 8
"""Random bits per element for stochastic rounding: k uniform in 0..255."""

STOCHASTIC_BIAS_BOUND = {2: 2.0**-9, 4: 2.0**-9, 8: 2.0**-9}
"""Largest |E[code] - v| of stochastic rounding, in units of the group's scale (exact)."""

# --- scratch space and chunking --------------------------------------------------

class Scratch:
    """The chunk-sized buffers one chunk in flight works in."""

    def __init__(self, elements: int, device: torch.device, noise: bool = False):
        self.work = torch.empty(elements, dtype=torch.float32, device=device)
        # spare: staging and ping-pong inside fill(), then the chunk's noise (as int32).
        self.spare = torch.empty(elements, dtype=torch.float32, device=device)
        self.extra = None  # a third fp32 buffer, made on demand
        self.codes = torch.empty(elements, dtype=torch.int8, device=device)
        self.noise = NoiseBuffer(elements, device) if noise else None
        # stochastic rounding: the exact products (fp64) and the codes (int32)
        self.wide = torch.empty(elements, dtype=torch.float64, device=device) if noise else None
        self.codes32 = torch.empty(elements, dtype=torch.int32, device=device) if noise else None

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
    parallelism comes from whole chunks instead (``run_chunks``). With torch's
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


def run_chunks(
    device: torch.device,
    count: int,
    elements: int,
    work: Callable[[int, Scratch], None],
    draw: Optional[Callable[[int, Scratch], None]] = None,
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
            scratch = Scratch(elements, device, noise=draw is not None)
            for i in range(count):
                if draw is not None:
                    draw(i, scratch)
                work(i, scratch)
            return
        scratches = [Scratch(elements, device, noise=draw is not None) for _ in range(workers + 1)]
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


def chunk_groups(device: torch.device, group_size: int, total_groups: int, align: int = 1) -> int:
    """Groups per chunk: a multiple of ``align``, cache-sized on CPU, all groups elsewhere."""
    if device.type != "cpu":
        return max(total_groups, align)
    target = max(CPU_MIN_CHUNK_ELEMENTS, total_groups * group_size // 8)
    return max(align, min(CPU_CHUNK_ELEMENTS, target) // group_size // align * align)


def read_fp32(flat: torch.Tensor, start: int, stop: int, limit: int,
              staging: torch.Tensor) -> torch.Tensor:
    """Elements [start, stop) of ``flat`` as fp32, zero from element ``limit`` on.

    A view of ``flat`` when it is fp32 and the range lies below ``limit``;
    otherwise the values are converted into ``staging`` (which is returned).
    """
    if stop <= limit and flat.dtype == torch.float32:
        return flat[start:stop]
    have = max(0, min(stop, limit) - start)
    out = staging[: stop - start]
    out[:have].copy_(flat[start:start + have])
    out[have:].zero_()
    return out


# --- the quantizer ---------------------------------------------------------------

class NoiseBuffer:
    """One chunk's random bytes k (one per element), drawn in chunk order."""

    def __init__(self, elements: int, device: torch.device):
        self.words = torch.empty(-(-elements * NOISE_BITS // 64), dtype=torch.int64, device=device)

    def draw(self, elements: int, generator: Optional[torch.Generator]) -> None:
        """Draw the bytes of ``elements`` elements (the serial part: call in chunk order)."""
        words = self.words[: -(-elements * NOISE_BITS // 64)]
        words.random_(-(2**63), None, generator=generator)  # all 64 bits random

    def bytes_(self, out: torch.Tensor) -> torch.Tensor:
        """The first ``out.numel()`` bytes of the last draw, into int32 ``out`` (any thread)."""
        return out.copy_(self.words.view(torch.uint8)[: out.numel()])


def stochastic_codes(x: torch.Tensor, inv: torch.Tensor, k: torch.Tensor, wide: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """floor((rne(256 x inv) + k) / 256) into int32 ``out`` (returned): fp32 x [groups,
    group_size], fp32 inv [groups], int32 k in 0..255; v = x * inv is the exact product.

    With k uniform, E[code] = rne(256 v) / 256 exactly (R = rne(256 v) = 256 a + b,
    0 <= b < 256: the code is a + 1 for the b values k >= 256 - b, else a), so
    |E[code] - v| = |rne(256 v) - 256 v| / 256 <= 2^-9, for every v with |v| < 2^14.
    ``wide`` (fp64, x's shape) is scratch: the product of two fp32 values has at most
    48 significant bits, so it is exact in fp64, and so are the scaling by 256 and the
    rounding half to even (torch.round), which the kernels' one fma (x * inv +
    1.5 * 2^15, rounded once onto the 1/256 grid) computes as well.
    """
    wide.copy_(x).mul_(inv.to(torch.float64).unsqueeze(1)).mul_(256.0).round_()
    return out.copy_(wide).add_(k).bitwise_right_shift_(8)


def nearest_codes_(scaled: torch.Tensor) -> torch.Tensor:
    """floor(v + 1/2) in place (fp32); returns ``scaled``."""
    return scaled.add_(0.5).floor_()


def quantize_chunk(
    src: torch.Tensor,
    scales_out: torch.Tensor,
    codes_out: torch.Tensor,
    bits: int,
    levels_divisor: torch.Tensor,
    noise: Optional[torch.Tensor],
    scratch: Scratch,
) -> None:
    """Quantize fp32 ``src`` [groups, group_size] into ``scales_out`` and ``codes_out``.

    ``levels_divisor`` holds qmax(bits) once per group: the scale divides by a
    tensor, because torch on CUDA turns division by a Python scalar into
    multiplication by its reciprocal, which is not the contract. ``noise``
    (int32 k in 0..255, one per element) selects stochastic rounding. ``src`` may
    be ``scratch.work`` itself (it is then consumed).
    """
    levels = qmax(bits)
    torch.amax(src, dim=1, out=scales_out)
    # absmax = max(max, -min): two read-only reductions beat abs() + amax.
    torch.maximum(scales_out, torch.amin(src, dim=1).neg_(), out=scales_out)  # NaN propagates
    scales_out.div_(levels_divisor)
    # inv = 1/scale for a finite scale > 0 whose inverse is finite, else 0: the group
    # is unusable and its codes are 0 (NaN > 0 is false; 1/Inf is 0; a scale below
    # ~2^-128 has an infinite inverse).
    inv = torch.where(scales_out > 0, scales_out.reciprocal(), 0.0)
    inv.masked_fill_(torch.isinf(inv), 0.0)
    n = src.numel()
    if noise is None:
        rounded = nearest_codes_(torch.mul(src, inv.unsqueeze(1),
                                           out=scratch.work[:n].view(src.shape)))
    else:
        rounded = stochastic_codes(src, inv, noise.view(src.shape),
                                   scratch.wide[:n].view(src.shape),
                                   scratch.codes32[:n].view(src.shape))
    # In a usable group |v| <= qmax * (1 + 3 * 2^-24), so both roundings give codes in
    # [-qmax, qmax]. scale * inv is 1 in a usable group, 0 in an unusable finite one
    # (whose v are 0: codes 0), NaN or Inf in a group holding NaN/Inf: one dot finds those.
    if not math.isfinite(float(torch.dot(scales_out, inv))):
        rounded.masked_fill_(~torch.isfinite(scales_out).unsqueeze(1), 0)  # rare
    codes = scratch.codes[: src.numel()]
    codes.copy_(rounded.view(-1))
    codes.clamp_(-levels - 1, levels)  # a no-op by the bound above; kept as a guard
    pack_codes_(codes, bits, codes_out.view(torch.int8) if bits == 8 else codes_out)


Fill = Callable[[int, int, int, Scratch], torch.Tensor]
"""fill(start, stop, limit, scratch): elements [start, stop) of the flat source as
fp32, zero from element ``limit`` on (a view of the caller's data or a scratch buffer)."""


def quantize_stream(fill: Fill, out: QuantizedTensor, rounding: str,
                    generator: Optional[torch.Generator], align: int = 1) -> QuantizedTensor:
    """Quantize the flat source that ``fill`` yields into ``out`` (flat or k chunks).

    Chunk c of ``out`` holds source elements [c*n, (c+1)*n) (n = out.chunk_numel),
    padded to whole groups on its own. ``fill`` is asked for ranges that start on
    multiples of ``group_size`` and of ``align`` within a chunk.
    """
    group_size, bits = out.group_size, out.bits
    n = out.chunk_numel
    groups = num_groups(n, group_size)
    if groups == 0:
        return out
    width = codes_per_byte(bits)
    device = out.codes.device
    step = min(groups, chunk_groups(device, group_size, groups * out.num_chunks,
                                    align // math.gcd(align, group_size)))
    flat = out.codes.dim() == 1
    bounds = [(c, g0, min(g0 + step, groups)) for c in range(out.num_chunks)
              for g0 in range(0, groups, step)]
    divisor = torch.full((step,), float(qmax(bits)), device=device)
    stochastic = rounding == "stochastic"

    def draw(i: int, scratch: Scratch) -> None:
        _, g0, g1 = bounds[i]
        scratch.noise.draw((g1 - g0) * group_size, generator)

    def work(i: int, scratch: Scratch) -> None:
        c, g0, g1 = bounds[i]
        count = (g1 - g0) * group_size
        base = c * n
        src = fill(base + g0 * group_size, base + g1 * group_size, base + n, scratch)
        # fill() is done with scratch.spare (its result is never spare): the noise goes there.
        noise = (scratch.noise.bytes_(scratch.spare[:count].view(torch.int32)) if stochastic
                 else None)
        codes = out.codes if flat else out.codes[c]
        scales = out.scales if flat else out.scales[c]
        quantize_chunk(src.view(g1 - g0, group_size), scales[g0:g1],
                       codes[g0 * group_size // width: g1 * group_size // width],
                       bits, divisor[: g1 - g0], noise, scratch)

    run_chunks(device, len(bounds), step * group_size, work, draw if stochastic else None)
    return out


def empty_quantized(bits: int, group_size: int, numel: int, dtype: torch.dtype,
                    device: torch.device) -> QuantizedTensor:
    """A flat QuantizedTensor of ``numel`` elements, uninitialised."""
    return QuantizedTensor(
        codes=torch.empty(QuantizedTensor.codes_nbytes(numel, bits, group_size),
                          dtype=torch.int8 if bits == 8 else torch.uint8, device=device),
        scales=torch.empty(num_groups(numel, group_size), dtype=torch.float32, device=device),
        bits=bits, group_size=group_size, numel=numel, dtype=dtype,
    )


# --- the dequantizer -------------------------------------------------------------

def dequantize_groups_into(q: QuantizedTensor, g0: int, g1: int, dest: torch.Tensor,
                           codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of groups [g0, g1) of flat ``q`` (padding included) into ``dest``; returns it."""
    n = (g1 - g0) * q.group_size
    width = codes_per_byte(q.bits)
    codes = codes[:n]
    unpack_codes_(q.codes[g0 * q.group_size // width: g1 * q.group_size // width], q.bits, codes)
    dest = dest[:n]
    dest.copy_(codes)
    dest.view(g1 - g0, q.group_size).mul_(q.scales[g0:g1].unsqueeze(1))
    return dest


def flat_chunks(q: QuantizedTensor, num_chunks: int) -> list:
    """The chunks of ``q`` as flat QuantizedTensors (views): its rows, or for the
    flat form ``num_chunks`` equal slices (each whole groups)."""
    if q.codes.dim() == 2:
        return [q.chunk(c) for c in range(q.num_chunks)]
    if num_chunks == 1:
        return [q]
    n = q.numel // num_chunks
    nbytes, groups = QuantizedTensor.codes_nbytes(n, q.bits, q.group_size), n // q.group_size
    return [QuantizedTensor(q.codes[c * nbytes: (c + 1) * nbytes],
                            q.scales[c * groups: (c + 1) * groups], q.bits, q.group_size, n, q.dtype)
            for c in range(num_chunks)]


def for_each_group_range(q: QuantizedTensor, body: Callable[[int, QuantizedTensor, int, int, Scratch], None]) -> None:
    """Call ``body(c, chunk_c, g0, g1, scratch)`` over cache-sized group ranges of every chunk."""
    chunks = flat_chunks(q, 1)
    groups = chunks[0].num_groups
    step = min(groups, chunk_groups(q.device, q.group_size, groups * len(chunks)))
    bounds = [(c, g0, min(g0 + step, groups)) for c in range(len(chunks))
              for g0 in range(0, groups, step)]
    run_chunks(q.device, len(bounds), step * q.group_size,
               lambda i, scratch: body(bounds[i][0], chunks[bounds[i][0]], bounds[i][1],
                                       bounds[i][2], scratch))


def sum_chunks_into(chunks: list, start: int, stop: int, limit: int, dest: torch.Tensor,
                    temp: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """dest[:stop-start] <- sum over chunks (in order) of their elements [start, stop).

    ``start`` is a multiple of the chunks' group size; elements from ``limit``
    (at most a chunk's length) on are 0.
    """
    size = chunks[0].group_size
    have = max(0, min(stop, limit) - start)
    dest = dest[: stop - start]
    g0 = start // size
    g1 = g0 + -(-have // size)
    for c, chunk in enumerate(chunks):
        if c == 0:
            dequantize_groups_into(chunk, g0, g1, dest, codes)
        else:
            dest[:have].add_(dequantize_groups_into(chunk, g0, g1, temp, codes)[:have])
    dest[have:].zero_()  # after: chunk 0's last group may have written past ``have``
    return dest
