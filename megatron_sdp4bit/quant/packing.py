"""Packing signed low-bit codes into bytes, and back (torch reference).

Codes are two's-complement in ``bits`` bits. Code i of a byte sits at bit offset
``i * bits``: for 4-bit, element 2j is the low nibble of byte j and 2j+1 the high
nibble. 8-bit codes are plain int8 and are not packed.
"""
from __future__ import annotations

import torch

from megatron_sdp4bit.quant.types import check_bits, codes_per_byte


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes in [-2^(b-1), 2^(b-1)-1] -> uint8 bytes (int8 for 8 bits)."""
    check_bits(bits)
    flat = codes.reshape(-1)
    if bits == 8:
        return flat.to(torch.int8)
    width = codes_per_byte(bits)
    if flat.numel() % width:
        raise ValueError(
            f"{flat.numel()} codes cannot be packed {width} per byte; pad to a multiple of {width}"
        )
    mask = (1 << bits) - 1
    fields = (flat.view(-1, width).to(torch.int32) & mask)
    shifts = torch.arange(0, 8, bits, device=flat.device, dtype=torch.int32)
    return (fields << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int | None = None) -> torch.Tensor:
    """uint8 bytes -> int8 codes (sign-extended); ``numel`` trims the tail."""
    check_bits(bits)
    if bits == 8:
        out = packed.reshape(-1).view(torch.int8) if packed.dtype == torch.uint8 else packed.reshape(-1)
        return out if numel is None else out[:numel]
    mask = (1 << bits) - 1
    sign = 1 << (bits - 1)
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    fields = (packed.reshape(-1, 1).to(torch.int32) >> shifts) & mask
    codes = ((fields ^ sign) - sign).to(torch.int8).reshape(-1)
    return codes if numel is None else codes[:numel]
