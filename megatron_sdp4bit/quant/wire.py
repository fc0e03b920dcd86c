"""The wire layout: k quantized chunks in one uint8 buffer, one segment per chunk.

A collective sends one buffer per hop. Chunk c (the part for peer c, or from
peer c) occupies segment c: its packed codes, then its fp32 scales, each part
starting on a ``SEGMENT_ALIGN``-byte boundary, and the segment padded to a
multiple of ``SEGMENT_ALIGN`` so that every segment of the buffer starts aligned:

    | codes of chunk 0 | pad | scales of chunk 0 | pad | codes of chunk 1 | ...

16 bytes is the widest load a GPU thread issues: with every segment aligned the
kernels read and write all k chunks with 16-byte accesses. The gaps are at most
30 bytes per chunk (wire bytes: ``segment_nbytes``).

``wire_view`` gives the k-chunk ``QuantizedTensor`` over such a buffer without
copying (rows of ``codes`` and ``scales`` are strided views of it), so a
producer's ``out=`` writes straight into the send buffer and a consumer reads
the received buffer in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from megatron_sdp4bit.quant.types import QuantizedTensor, check_group_size, num_groups

SEGMENT_ALIGN = 16
"""Bytes every segment, and the scales inside it, are aligned to."""


def _align(nbytes: int) -> int:
    return -(-nbytes // SEGMENT_ALIGN) * SEGMENT_ALIGN


@dataclass(frozen=True)
class SegmentLayout:
    """Where one chunk's parts lie inside its segment (bytes)."""

    codes_nbytes: int
    scales_offset: int
    groups: int
    nbytes: int


def segment_layout(chunk_numel: int, bits: int, group_size: int) -> SegmentLayout:
    """The segment of a chunk of ``chunk_numel`` elements (padded to whole groups)."""
    check_group_size(group_size, bits)
    if not isinstance(chunk_numel, int) or chunk_numel < 0:
        raise ValueError(f"chunk_numel={chunk_numel!r} must be a non-negative integer")
    codes = QuantizedTensor.codes_nbytes(chunk_numel, bits, group_size)
    groups = num_groups(chunk_numel, group_size)
    offset = _align(codes)
    return SegmentLayout(codes, offset, groups, _align(offset + 4 * groups))


def segment_nbytes(chunk_numel: int, bits: int, group_size: int) -> int:
    """Bytes of one chunk's segment: aligned codes, then aligned fp32 scales."""
    return segment_layout(chunk_numel, bits, group_size).nbytes


def wire_view(buffer: torch.Tensor, num_chunks: int, chunk_numel: int, bits: int,
              group_size: int, dtype: torch.dtype = torch.float32) -> QuantizedTensor:
    """The k-chunk QuantizedTensor whose chunk c is segment c of ``buffer`` (no copy).

    ``buffer``: 1-D contiguous uint8 of at least ``num_chunks`` segments (the
    first ones are used), 4-byte aligned. ``dtype``: what dequantize returns by default.
    """
    layout = segment_layout(chunk_numel, bits, group_size)
    if not isinstance(num_chunks, int) or num_chunks <= 0:
        raise ValueError(f"num_chunks={num_chunks!r} must be a positive integer")
    need = num_chunks * layout.nbytes
    if (buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous()
            or buffer.numel() < need):
        raise ValueError(
            f"the wire buffer must be a 1-D contiguous uint8 tensor of at least {need} bytes "
            f"({num_chunks} segments of {layout.nbytes}), got {buffer.dtype} "
            f"{list(buffer.shape)}; allocate it with empty_wire")
    if buffer.data_ptr() % 4:
        raise ValueError("the wire buffer must start on a 4-byte boundary (its scales are fp32)")
    segments = buffer[:need].view(num_chunks, layout.nbytes)
    codes = segments[:, : layout.codes_nbytes]
    if bits == 8:
        codes = codes.view(torch.int8)
    scales = segments[:, layout.scales_offset: layout.scales_offset + 4 * layout.groups]
    return QuantizedTensor(codes=codes, scales=scales.view(torch.float32), bits=bits,
                           group_size=group_size, numel=num_chunks * chunk_numel, dtype=dtype)


def empty_wire(num_chunks: int, chunk_numel: int, bits: int, group_size: int,
               device, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, QuantizedTensor]:
    """A new wire buffer of ``num_chunks`` segments and its ``wire_view``.

    Uninitialised, like ``torch.empty``: a producer's ``out=`` fills every byte
    the consumers read (the alignment gaps stay undefined and are never read).
    """
    layout = segment_layout(chunk_numel, bits, group_size)
    buffer = torch.empty(num_chunks * layout.nbytes, dtype=torch.uint8, device=device)
    return buffer, wire_view(buffer, num_chunks, chunk_numel, bits, group_size, dtype)
