"""Blockwise Walsh-Hadamard transform (torch reference).

H is the unnormalised Sylvester matrix of size ``block`` (entries +-1), applied to
each consecutive block of ``block`` elements. H @ H = block * I, so the inverse is
H / block. Computed with log2(block) butterfly stages (O(n log n)), in fp32.
"""
from __future__ import annotations

import torch

from megatron_sdp4bit.quant.types import check_hadamard_block


def hadamard_transform(x: torch.Tensor, block: int = 32, inverse: bool = False) -> torch.Tensor:
    """Return H x per block as fp32 (H x / block when ``inverse``); same shape as x.

    ``x.numel()`` must be a multiple of ``block``; bf16 and fp32 inputs are
    computed in fp32.
    """
    check_hadamard_block(block)
    if x.numel() % block:
        raise ValueError(
            f"hadamard_transform: {x.numel()} elements is not a multiple of block={block}; "
            "pad the input to a multiple of the block"
        )
    y = x.reshape(-1, block).to(torch.float32, copy=True)
    h = 1
    while h < block:
        # Pair element i with i + h inside each 2h-sized sub-block: (a, b) -> (a+b, a-b).
        pairs = y.view(-1, block // (2 * h), 2, h)
        a = pairs[:, :, 0, :]
        b = pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).view(-1, block)
        h *= 2
    if inverse:
        y.mul_(1.0 / block)
    return y.view(x.shape)
