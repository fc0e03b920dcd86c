"""Blockwise Hadamard transform against scipy.linalg.hadamard (an independent reference)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.linalg import hadamard

from megatron_sdp4bit.quant import hadamard as hadamard_module
from megatron_sdp4bit.quant.hadamard import butterfly, hadamard_transform, staging_buffer

BLOCKS = [2, 4, 8, 16, 32, 64, 128, 256]


def scipy_blockwise(x: torch.Tensor, block: int) -> np.ndarray:
    """H x per block in float64 (exact for these inputs up to fp64 rounding)."""
    rows = x.to(torch.float64).numpy().reshape(-1, block)
    return (rows @ hadamard(block).T).reshape(x.shape)


def fp32_sum_tolerance(x: torch.Tensor, block: int) -> np.ndarray:
    """Bound on |fp32 butterfly - exact| per element, broadcast over each block.

    Each of the log2(block) stages rounds once, relative 2^-24 of a partial sum
    no larger than the block's sum of |x|.
    """
    rows = x.to(torch.float64).abs().numpy().reshape(-1, block).sum(axis=1, keepdims=True)
    stages = int(np.log2(block))
    return np.broadcast_to(stages * 2.0**-24 * rows, (rows.shape[0], block)).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_matches_scipy_hadamard_for_every_block(block, dtype):
    gen = torch.Generator().manual_seed(block)
    x = (torch.randn(3 * block + 0, generator=gen) * 10).to(dtype).view(3, block)
    y = hadamard_transform(x, block)
    assert y.dtype == torch.float32 and y.shape == x.shape
    error = np.abs(y.numpy().astype(np.float64) - scipy_blockwise(x, block))
    assert (error <= fp32_sum_tolerance(x, block)).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_inverse_undoes_the_transform(block):
    gen = torch.Generator().manual_seed(100 + block)
    x = torch.randn(5 * block, generator=gen)
    y = hadamard_transform(x, block)
    back = hadamard_transform(y, block, inverse=True)
    # H H = block I: applying H twice gives block * x, the inverse divides by block.
    twice = hadamard_transform(y, block)
    assert torch.allclose(twice / block, x, rtol=0, atol=1e-5 * float(x.abs().max()) * np.log2(block))
    assert torch.allclose(back, x, rtol=0, atol=1e-5 * float(x.abs().max()) * np.log2(block))
    assert torch.equal(back, twice * (1.0 / block))  # the inverse is exactly H / block


def test_many_chunks_give_the_same_bits_as_one(monkeypatch):
    x = torch.randn(32 * 1000, generator=torch.Generator().manual_seed(0))
    whole = hadamard_transform(x, 32)
    monkeypatch.setattr(hadamard_module, "_CPU_CHUNK_ELEMENTS", 96)  # 3 blocks per chunk
    assert torch.equal(hadamard_transform(x, 32), whole)
    assert torch.equal(hadamard_transform(x.to(torch.bfloat16), 32),
                       hadamard_transform(x.to(torch.bfloat16).float(), 32))


def test_stage_order_is_the_documented_butterfly():
    # Row 0 of H_4 is (x0 + x1) + (x2 + x3) in fp32: 1 + 2^-24 rounds to 1 and
    # -1 + 2^-24 is exact, so the result is 2^-24. Pairing by h = 2 first would
    # give (x0 + x2) + (x1 + x3) = 2^-23.
    x = torch.tensor([1.0, 2.0**-24, -1.0, 2.0**-24])
    assert hadamard_transform(x, 4)[0].item() == 2.0**-24


def test_empty_and_shape():
    assert hadamard_transform(torch.empty(0), 8).shape == (0,)
    x = torch.randn(2, 3, 8)
    assert hadamard_transform(x, 8).shape == (2, 3, 8)


@pytest.mark.parametrize("block", [0, 1, 3, 24, 512, -4])
def test_block_must_be_a_power_of_two_in_range(block):
    with pytest.raises(ValueError, match="power of two between 2 and 256"):
        hadamard_transform(torch.zeros(1024), block)


def test_length_must_be_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="not a multiple of block=32; pad the input"):
        hadamard_transform(torch.zeros(48), 32)


def test_butterfly_refuses_an_input_its_first_stage_would_overwrite():
    dest, spare = torch.zeros(8), torch.zeros(8)
    wrong = spare if staging_buffer(dest, spare, 8) is dest else dest
    with pytest.raises(ValueError, match="staging_buffer"):
        butterfly(wrong, dest, spare, 8)
