"""Packing signed low-bit codes into bytes, and back (torch reference).

Codes are two's-complement in ``bits`` bits. Code i of a byte sits at bit offset
``i * bits``: for 4-bit, element 2j is the low nibble of byte j and 2j+1 the high
nibble. 8-bit codes are plain int8 and are not packed.

Speed: a byte's 2 (4-bit) or 4 (2-bit) int8 codes are read as one int16 / int32
word, so every step is a contiguous whole-tensor integer op; strided per-field
ops are several times slower on CPU. The word trick assumes a little-endian
host (every platform torch ships for); big-endian hosts take the per-field path.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from megatron_sdp4bit.quant.types import check_bits, codes_per_byte

_LITTLE_ENDIAN = sys.byteorder == "little"
# The int type holding the int8 codes of one packed byte, and a mask keeping the
# low ``bits`` bits of each of them.
_WORD = {4: torch.int16, 2: torch.int32}
_FIELD_MASK = {4: 0x0F0F, 2: 0x03030303}
# XOR with 2^(bits-1) in every byte maps a field f in [0, 2^bits) to f + 2^(b-1)
# mod 2^bits; subtracting 2^(b-1) then sign-extends it (see _unpack_word_).
_SIGN_BIT = {4: 0x0808, 2: 0x02020202}


def _check_packable(numel: int, bits: int) -> None:
    width = codes_per_byte(bits)
    if numel % width:
        raise ValueError(
            f"{numel} codes cannot be packed {width} per byte; pad to a multiple of {width}"
        )


def pack_codes_(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Pack contiguous int8 ``codes`` into ``out`` (uint8, numel/width), clobbering ``codes``.

    The in-place variant the chunked quantizers use on their scratch buffers.
    """
    if bits == 8:
        return out.copy_(codes.view(-1))
    _check_packable(codes.numel(), bits)
    if not _LITTLE_ENDIAN:
        return out.copy_(_pack_per_field(codes, bits))
    word = codes.view(-1).view(_WORD[bits])
    word.bitwise_and_(_FIELD_MASK[bits])
    # Fold the higher fields down next to field 0: afterwards the low byte of
    # each word holds every field at its offset i * bits.
    if bits == 4:
        word.bitwise_or_(word >> 4)
    else:
        word.bitwise_or_(word >> 6)
        word.bitwise_or_(word >> 12)
    # Integer narrowing keeps the low byte (two's-complement wrap-around).
    return out.copy_(word)


def pack_codes(codes: torch.Tensor, bits: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int8 codes in [-2^(b-1), 2^(b-1)-1] -> uint8 bytes (int8 for 8 bits).

    ``codes`` (any integer dtype, any shape) is read flattened and left untouched;
    its length must be a multiple of the codes per byte (8 // bits).
    """
    check_bits(bits)
    flat = codes.reshape(-1)
    if bits == 8:
        packed = flat.to(torch.int8)
        return packed if out is None else out.copy_(packed)
    _check_packable(flat.numel(), bits)
    scratch = flat.to(torch.int8, copy=True)  # wraps mod 256: the low bits are kept
    if out is None:
        out = torch.empty(flat.numel() // codes_per_byte(bits), dtype=torch.uint8,
                          device=flat.device)
    return pack_codes_(scratch, bits, out)


def unpack_codes_(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Unpack contiguous bytes into ``out`` (int8, numel = bytes * width) and return it."""
    if bits == 8:
        return out.copy_(packed.view(-1).view(torch.int8))
    if not _LITTLE_ENDIAN:
        return out.copy_(_unpack_per_field(packed, bits))
    word = out.view(-1).view(_WORD[bits])
    word.copy_(packed.view(-1).view(torch.uint8))  # zero-extends each byte into a word
    # Spread field i of the byte into byte i of the word, then mask the rest off.
    if bits == 4:
        word.bitwise_or_(word << 4)
    else:
        word.bitwise_or_((word << 6) | (word << 12) | (word << 18))
    word.bitwise_and_(_FIELD_MASK[bits])
    word.bitwise_xor_(_SIGN_BIT[bits])
    # Per byte now f + 2^(b-1) (mod 2^b) in [0, 2^b): subtracting 2^(b-1) gives the
    # signed code; no byte borrows because this runs on the int8 view.
    return out.sub_(1 << (bits - 1))


def unpack_codes(packed: torch.Tensor, bits: int, numel: int | None = None) -> torch.Tensor:
    """uint8 bytes -> int8 codes (sign-extended); ``numel`` trims the tail."""
    check_bits(bits)
    flat = packed.reshape(-1)
    if bits == 8:
        codes = flat.view(torch.int8) if flat.dtype == torch.uint8 else flat.to(torch.int8)
        return codes if numel is None else codes[:numel]
    if flat.dtype not in (torch.uint8, torch.int8):
        flat = flat.to(torch.uint8)  # other integer dtypes: keep the low byte
    out = torch.empty(flat.numel() * codes_per_byte(bits), dtype=torch.int8, device=flat.device)
    unpack_codes_(flat.contiguous(), bits, out)
    return out if numel is None else out[:numel]


# --- per-field path: big-endian hosts, and an independent check in the tests ----------

def _pack_per_field(codes: torch.Tensor, bits: int) -> torch.Tensor:
    width = codes_per_byte(bits)
    fields = codes.reshape(-1, width).to(torch.int32) & ((1 << bits) - 1)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.int32)
    return (fields << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unpack_per_field(packed: torch.Tensor, bits: int) -> torch.Tensor:
    sign = 1 << (bits - 1)
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    fields = (packed.reshape(-1, 1).to(torch.int32) & 0xFF) >> shifts & ((1 << bits) - 1)
    return ((fields ^ sign) - sign).to(torch.int8).reshape(-1)
