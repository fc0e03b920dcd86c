"""Blockwise Walsh-Hadamard transform (torch reference).

H is the unnormalised Sylvester matrix of size ``block`` (entries +-1), applied to
each consecutive block of ``block`` elements. H @ H = block * I, so the inverse is
H / block.

Computed in fp32 with log2(block) butterfly stages, h = 1, 2, 4, ..., block/2:
stage h maps each pair (a, b) = (y[i], y[i + h]) of a 2h-sized sub-block to
(a + b, a - b), each rounded once. Floating-point sums are not associative, so a
kernel that wants bit-identical results must use the same stage order (the
stages commute only in exact arithmetic).
"""
from __future__ import annotations

import torch

from megatron_sdp4bit.quant.types import check_hadamard_block

# Elements per chunk on CPU: the two fp32 ping-pong buffers (2 MiB) stay in L2.
_CPU_CHUNK_ELEMENTS = 1 << 18


def _stages(block: int) -> int:
    return block.bit_length() - 1


def staging_buffer(dest: torch.Tensor, spare: torch.Tensor, block: int) -> torch.Tensor:
    """The one of ``dest``/``spare`` an input may be staged in before ``butterfly``.

    The first stage must not write the buffer it reads, and the last one must
    write ``dest``: with an odd stage count the first stage writes ``dest``, so
    the input goes in ``spare``; with an even count it is the other way round.
    """
    return spare if _stages(block) % 2 else dest


def butterfly(src: torch.Tensor, dest: torch.Tensor, spare: torch.Tensor, block: int) -> torch.Tensor:
    """``dest`` <- H ``src`` per block (unnormalised), through ``spare``; returns ``dest``.

    All three are contiguous fp32 tensors of the same numel, a multiple of
    ``block``. ``src`` may be ``staging_buffer(dest, spare, block)`` (it is then
    overwritten), or any tensor that aliases neither buffer.
    """
    first, second = (dest, spare) if _stages(block) % 2 else (spare, dest)
    if src.data_ptr() == first.data_ptr():
        raise ValueError("butterfly: stage the input in staging_buffer(dest, spare, block)")
    current, targets = src, (first, second)
    h, stage = 1, 0
    while h < block:
        target = targets[stage % 2]
        a, b = current.view(-1, block // (2 * h), 2, h).unbind(2)
        sum_half, diff_half = target.view(-1, block // (2 * h), 2, h).unbind(2)
        torch.add(a, b, out=sum_half)
        torch.sub(a, b, out=diff_half)
        current = target
        h *= 2
        stage += 1
    return dest


def hadamard_transform(x: torch.Tensor, block: int = 32, inverse: bool = False) -> torch.Tensor:
    """Return H x per block as fp32 (H x / block when ``inverse``); same shape as x.

    ``x.numel()`` must be a multiple of ``block``; bf16 and fp32 inputs are
    computed in fp32 (the bf16 -> fp32 conversion is exact).
    """
    check_hadamard_block(block)
    if x.numel() % block:
        raise ValueError(
            f"hadamard_transform: {x.numel()} elements is not a multiple of block={block}; "
            "pad the input to a multiple of the block"
        )
    flat = x.reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.float32, device=x.device)
    if flat.numel() == 0:
        return out.view(x.shape)
    step = _chunk_elements(flat, block)
    spare = torch.empty(min(step, flat.numel()), dtype=torch.float32, device=x.device)
    for start in range(0, flat.numel(), step):
        stop = min(start + step, flat.numel())
        dest = out[start:stop]
        src = flat[start:stop]
        if src.dtype != torch.float32 or not src.is_contiguous():
            src = staging_buffer(dest, spare[: stop - start], block).copy_(src)
        butterfly(src, dest, spare[: stop - start], block)
    if inverse:
        out.mul_(1.0 / block)  # a power of two: exact
    return out.view(x.shape)


def _chunk_elements(flat: torch.Tensor, block: int) -> int:
    """Chunk length (a multiple of ``block``): cache-sized on CPU, everything elsewhere."""
    if flat.device.type != "cpu":
        return max(flat.numel(), block)
    return max(block, _CPU_CHUNK_ELEMENTS // block * block)
