"""Compile at install, not in step 1: run once every kernel variant the collectives need.

Triton compiles a kernel variant the first time a call needs it (1-2 s each, on
every rank, inside the first training step). A variant is fixed by the call's
op, formats and dtypes, the chunk counts compiled in, the tile (from the size)
and the divisibility by 16 of its sizes and strides. ``warm_up(specs, device)``
makes each ``KernelSpec``'s call once on zero-filled tensors of that layout, so
Triton compiles (and caches for the process) exactly the variants the real
calls will find. Triton also specialises on a pointer's 16-byte alignment (and
the kernels read bf16 as 32-bit words where it is 4-byte aligned): a float tensor
the real call takes at a position in a caller's buffer (a shard at its rank's
offset in a bucket: unaligned when shard x element size is not a multiple of 16,
e.g. DP 128 with bf16 parameters) is placed at the same offset, ``KernelSpec.offset``;
everything else is a fresh allocation, aligned, as the collectives' own buffers are.

On a device whose tensors go to the torch reference (CPU, or
SDP4BIT_QUANT_BACKEND=torch) there is nothing to compile: it returns 0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from megatron_sdp4bit.quant.types import QuantizedTensor, check_format
from megatron_sdp4bit.quant.wire import empty_wire

OPS = ("quantize", "quantize_weight_diff", "hadamard_quantize", "hadamard_quantize_rows",
       "dequantize", "dequantize_add_", "dequantize_sum", "dequantize_sum_requantize")


@dataclass(frozen=True)
class KernelSpec:
    """One kind of call a collective makes, as much of it as picks the kernel variant."""

    op: str
    """One of ``OPS``."""
    numel: int
    """Elements of the quantized tensor the op makes (producers) or reads (consumers),
    all chunks together, as in a representative real call (e.g. a bucket's shard, a
    pipeline chunk): its divisibility and size pick the variant."""
    bits: int
    """Bits of that quantized tensor's codes."""
    group_size: int
    """Its group size."""
    chunks: int = 1
    """Its chunks: wire segments (producers' ``out``, consumers' input), or the chunks
    ``dequantize_sum*`` sum (its ``num_chunks``)."""
    wire: bool = True
    """The quantized tensor is a wire view (one segment per chunk); False: flat."""
    rounding: str = "stochastic"
    """Producers' rounding."""
    dtype: torch.dtype = torch.float32
    """The float side: producers' input (rows, x, the model shard of qWD), consumers'
    output (dequantize, dequantize_sum) or base (dequantize_add_)."""
    hadamard_block: Optional[int] = None
    """hadamard_quantize*: the block; dequantize_sum: the inverse block."""
    scaled: bool = False
    """hadamard_quantize*: a scale other than 1 (1/DP of an averaging reduce-scatter)."""
    out_bits: Optional[int] = None
    """dequantize_sum_requantize: the output's bits (default ``bits``)."""
    out_group_size: Optional[int] = None
    """dequantize_sum_requantize: the output's group size (default ``group_size``)."""
    out_chunks: int = 1
    """dequantize_sum_requantize: wire segments of the output."""
    rows: int = 1
    """hadamard_quantize_rows: P, the rows (``numel`` = P * padded)."""
    row_numel: Optional[int] = None
    """hadamard_quantize_rows: elements of a source row (the shard); dequantize_add_: a
    base of ``chunks`` rows of this length, the op adding into columns [start, start + n)
    of each (None: a flat base)."""
    start: int = 0
    """The first column read (rows op) or written (dequantize_add_ with ``row_numel``)."""
    valid: Optional[int] = None
    """hadamard_quantize_rows: columns read per row (None: all of ``padded``)."""
    ordered: bool = False
    """hadamard_quantize_rows: rows taken through an order tensor (a send order)."""
    offset: int = 0
    """Elements past a 16-byte boundary at which the real call's float tensor in a
    caller's buffer starts: the rows (hadamard_quantize_rows), the model shard
    (quantize_weight_diff), the base's first row (dequantize_add_), the output
    (dequantize_sum); 0 for the other ops."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"KernelSpec.op={self.op!r}; use one of {', '.join(OPS)}")
        check_format(self.bits, self.group_size, self.rounding)
        for name in ("numel", "chunks", "out_chunks", "rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KernelSpec.{name}={value!r} must be a positive integer")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"KernelSpec.offset={self.offset!r} must be a non-negative integer")
        if self.numel % self.chunks or self.numel % self.rows:
            raise ValueError(f"KernelSpec.numel={self.numel} must be a multiple of chunks "
                             f"({self.chunks}) and rows ({self.rows})")


def _quantized(numel: int, bits: int, group: int, chunks: int, wire: bool,
               device) -> QuantizedTensor:
    """A zero-filled quantized tensor: ``chunks`` wire segments, or flat."""
    if wire:
        q = empty_wire(chunks, numel // chunks, bits, group, device)[1]
    else:
        q = QuantizedTensor(torch.empty(QuantizedTensor.codes_nbytes(numel, bits, group),
                                        dtype=torch.int8 if bits == 8 else torch.uint8, device=device),
                            torch.empty(-(-numel // group), device=device), bits, group, numel)
    q.codes.zero_()
    q.scales.zero_()
    return q


def _producer_out(spec: KernelSpec, device) -> Optional[QuantizedTensor]:
    return (_quantized(spec.numel, spec.bits, spec.group_size, spec.chunks, True, device)
            if spec.wire else None)


def _placed(shape, dtype, offset: int, device) -> torch.Tensor:
    """Zeros of ``shape`` starting ``offset`` elements into a fresh (aligned) allocation."""
    numel = 1
    for size in shape:
        numel *= size
    return torch.zeros(offset + numel, dtype=dtype, device=device)[offset:].view(*shape)


def run_spec(spec: KernelSpec, device) -> None:
    """Make ``spec``'s call once on zero-filled tensors on ``device``."""
    from megatron_sdp4bit import quant

    s, zeros = spec, lambda *shape, dtype=spec.dtype: torch.zeros(*shape, dtype=dtype, device=device)
    placed = lambda *shape: _placed(shape, spec.dtype, spec.offset, device)  # noqa: E731
    generator = torch.Generator(device=device) if s.rounding == "stochastic" else None
    fmt = dict(bits=s.bits, group_size=s.group_size, rounding=s.rounding, generator=generator)
    scale = 0.5 if s.scaled else 1.0
    if s.op == "quantize":
        quant.quantize(zeros(s.numel), **fmt, out=_producer_out(s, device))
    elif s.op == "quantize_weight_diff":
        quant.quantize_weight_diff(zeros(s.numel, dtype=torch.float32), placed(s.numel), **fmt,
                                   out=_producer_out(s, device))
    elif s.op == "hadamard_quantize":
        quant.hadamard_quantize(zeros(s.numel), **fmt, hadamard_block=s.hadamard_block,
                                scale=scale, out=_producer_out(s, device))
    elif s.op == "hadamard_quantize_rows":
        padded = s.numel // s.rows
        order = torch.arange(s.rows, device=device) if s.ordered else None
        quant.hadamard_quantize_rows(placed(s.rows, s.row_numel or padded), order, s.start,
                                     padded if s.valid is None else s.valid, padded, **fmt,
                                     hadamard_block=s.hadamard_block, scale=scale,
                                     out=_producer_out(s, device))
    else:
        q = _quantized(s.numel, s.bits, s.group_size, s.chunks, s.wire, device)
        n = s.numel // s.chunks
        if s.op == "dequantize":
            quant.dequantize(q, s.dtype)
        elif s.op == "dequantize_add_":
            base = (placed(s.numel) if s.row_numel is None
                    else placed(s.chunks, s.row_numel)[:, s.start: s.start + n])
            quant.dequantize_add_(base, q)
        elif s.op == "dequantize_sum":
            quant.dequantize_sum(q, s.chunks, s.hadamard_block, out=placed(n))
        else:
            bits, group = s.out_bits or s.bits, s.out_group_size or s.group_size
            out = _quantized(n, bits, group, s.out_chunks, True, device) if s.wire else None
            quant.dequantize_sum_requantize(q, s.chunks, bits, group, s.rounding, generator,
                                            out=out)


def warm_up(specs: Iterable[KernelSpec], device) -> float:
    """Compile (by running once) the kernel variants of ``specs`` on ``device``; seconds taken.

    Call it where the collectives are set up (e.g. at install), with one spec per kind
    of call: Triton keeps the variants for the process, so the first training step
    compiles nothing. Does nothing (returns 0.0) where the reference serves the device.
    """
    from megatron_sdp4bit.quant import backend_for, reference

    device = torch.device(device)
    if backend_for(torch.empty(0, device=device)) is reference:
        return 0.0
    start = time.perf_counter()
    for spec in specs:
        run_spec(spec, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
