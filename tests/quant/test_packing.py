"""Packing of 2/4/8-bit codes against a bit-by-bit Python model of the layout."""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_sdp4bit.quant import packing
from megatron_sdp4bit.quant.packing import pack_codes, unpack_codes


def layout_bytes(codes: list[int], bits: int) -> list[int]:
    """The documented layout, in plain Python: code i of a byte at bit offset i * bits."""
    width = 8 // bits
    out = []
    for start in range(0, len(codes), width):
        byte = 0
        for i, code in enumerate(codes[start:start + width]):
            byte |= (code & ((1 << bits) - 1)) << (i * bits)
        out.append(byte)
    return out


def every_code_tuple(bits: int) -> list[int]:
    """All combinations of codes in one byte: every byte value appears exactly once."""
    levels = range(-(1 << (bits - 1)), 1 << (bits - 1))
    return [c for combo in itertools.product(levels, repeat=8 // bits) for c in combo]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_is_a_bijection_over_every_code_value(bits):
    codes = every_code_tuple(bits)
    packed = pack_codes(torch.tensor(codes, dtype=torch.int8), bits)
    expected = layout_bytes(codes, bits)
    assert packed.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert (packed.view(torch.uint8) if bits == 8 else packed).tolist() == expected
    assert sorted(expected) == list(range(256))  # every byte reached once: a bijection
    assert unpack_codes(packed, bits).tolist() == codes


@pytest.mark.parametrize("bits", [2, 4])
def test_fast_and_per_field_paths_agree(bits):
    codes = torch.tensor(every_code_tuple(bits), dtype=torch.int8)
    packed = pack_codes(codes, bits)
    assert torch.equal(packed, packing._pack_per_field(codes, bits))
    assert torch.equal(packing._unpack_per_field(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_trims_to_numel_and_accepts_int8_bytes(bits):
    codes = torch.tensor(every_code_tuple(bits), dtype=torch.int8)
    packed = pack_codes(codes, bits)
    assert torch.equal(unpack_codes(packed, bits, numel=13), codes[:13])
    assert torch.equal(unpack_codes(packed.view(torch.int8), bits), codes)


def test_pack_leaves_its_input_alone_and_takes_any_integer_dtype():
    codes = torch.tensor([-8, 7, 3, -1, 0, 5], dtype=torch.int32)
    before = codes.clone()
    packed = pack_codes(codes, 4)
    assert torch.equal(codes, before)
    assert packed.tolist() == layout_bytes(codes.tolist(), 4)


@pytest.mark.parametrize("bits,length", [(4, 7), (2, 6), (2, 1)])
def test_lengths_that_do_not_fill_a_byte_are_rejected(bits, length):
    with pytest.raises(ValueError, match="pad to a multiple of"):
        pack_codes(torch.zeros(length, dtype=torch.int8), bits)


def test_odd_lengths_are_fine_for_8_bit():
    codes = torch.tensor([-128, 127, 5], dtype=torch.int8)
    assert torch.equal(unpack_codes(pack_codes(codes, 8), 8), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_empty_tensors(bits):
    packed = pack_codes(torch.empty(0, dtype=torch.int8), bits)
    assert packed.numel() == 0
    assert unpack_codes(packed, bits).numel() == 0


@pytest.mark.parametrize("bits", [0, 3, 16])
def test_unsupported_bits_are_rejected(bits):
    with pytest.raises(ValueError, match=r"use one of \(2, 4, 8\)"):
        pack_codes(torch.zeros(8, dtype=torch.int8), bits)
    with pytest.raises(ValueError, match=r"use one of \(2, 4, 8\)"):
        unpack_codes(torch.zeros(8, dtype=torch.uint8), bits)
