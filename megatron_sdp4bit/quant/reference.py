"""Torch reference of every quantization op: the specification the kernels match.

Quantizer: symmetric, group-wise, one fp32 scale per group
``scale = absmax / (2^(b-1) - 1)``; code = round(x / scale) clamped to
``[-2^(b-1), 2^(b-1) - 1]``; rounding ``nearest`` (floor(x/scale + 1/2): one
formula every backend computes bit for bit) or ``stochastic`` (floor(x/scale + u),
u ~ U[0,1), which is unbiased). Runs on any device.

Edge cases, by design:
- lengths that are not a multiple of the group size are zero-padded; the padding
  is stripped on dequantize;
- an all-zero group has scale 0 and dequantizes to exact zeros (no 0/0);
- a group holding NaN or Inf gets a non-finite scale and codes 0, so every element
  of that group dequantizes to NaN: overflow checks downstream still trip.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_sdp4bit.quant.hadamard import hadamard_transform
from megatron_sdp4bit.quant.packing import pack_codes, unpack_codes
from megatron_sdp4bit.quant.types import (
    QuantizedTensor,
    check_group_size,
    check_hadamard_group,
    check_rounding,
    num_groups,
    qmax,
)


def _grouped_fp32(x: torch.Tensor, group_size: int, scale: float = 1.0) -> torch.Tensor:
    """x as a fresh fp32 [groups, group_size] tensor, zero-padded, times ``scale``."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = num_groups(n, group_size) * group_size
    out = torch.zeros(padded, dtype=torch.float32, device=x.device)
    out[:n] = flat
    if scale != 1.0:
        out.mul_(scale)
    return out.view(-1, group_size)


def _quantize_groups(
    groups: torch.Tensor,
    bits: int,
    rounding: str,
    generator: Optional[torch.Generator],
    numel: int,
    dtype: torch.dtype,
) -> QuantizedTensor:
    """Quantize an fp32 [groups, group_size] tensor (consumed in place)."""
    group_size = groups.shape[1] if groups.dim() == 2 else 1
    if groups.numel() == 0:
        return QuantizedTensor(
            codes=torch.empty(0, dtype=torch.int8 if bits == 8 else torch.uint8, device=groups.device),
            scales=torch.empty(0, dtype=torch.float32, device=groups.device),
            bits=bits, group_size=group_size, numel=numel, dtype=dtype,
        )
    levels = qmax(bits)
    scales = groups.abs().amax(dim=1)  # NaN propagates, Inf stays Inf
    scales.div_(levels)
    usable = torch.isfinite(scales) & (scales > 0)
    inv = torch.where(usable, 1.0 / scales, torch.zeros_like(scales))
    scaled = groups.mul_(inv.unsqueeze(1))
    if rounding == "stochastic":
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=torch.float32)
        scaled.add_(noise).floor_()
    else:
        scaled.add_(0.5).floor_()
    scaled.clamp_(-levels - 1, levels)
    # Non-finite groups: codes 0 (the scale alone carries the NaN/Inf).
    scaled.masked_fill_(~usable.unsqueeze(1), 0.0)
    codes = pack_codes(scaled.to(torch.int8), bits)
    return QuantizedTensor(codes=codes, scales=scales, bits=bits, group_size=group_size,
                           numel=numel, dtype=dtype)


def _check(bits: int, group_size: int, rounding: str) -> None:
    check_group_size(group_size, bits)
    check_rounding(rounding)


def quantize(
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 2048,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
) -> QuantizedTensor:
    """Group-wise symmetric quantization of ``x`` (flattened)."""
    _check(bits, group_size, rounding)
    groups = _grouped_fp32(x, group_size)
    return _quantize_groups(groups, bits, rounding, generator, x.numel(), x.dtype)


def _dequantize_groups(q: QuantizedTensor) -> torch.Tensor:
    """fp32 [groups, group_size] values of ``q`` (padding included)."""
    codes = unpack_codes(q.codes, q.bits, q.padded_numel)
    values = codes.to(torch.float32).view(-1, q.group_size)
    return values.mul_(q.scales.unsqueeze(1))


def dequantize(q: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Values of ``q`` as a flat tensor of ``q.numel`` elements in ``dtype`` (default q.dtype)."""
    out_dtype = dtype or q.dtype
    if q.numel == 0:
        return torch.empty(0, dtype=out_dtype, device=q.device)
    return _dequantize_groups(q).view(-1)[: q.numel].to(out_dtype)


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
    _check(bits, group_size, rounding)
    if main_shard.numel() != model_shard.numel():
        raise ValueError(
            f"main shard has {main_shard.numel()} elements but model shard {model_shard.numel()}"
        )
    groups = _grouped_fp32(main_shard, group_size)
    groups.view(-1)[: main_shard.numel()].sub_(model_shard.reshape(-1).to(torch.float32))
    return _quantize_groups(groups, bits, rounding, generator, main_shard.numel(), torch.float32)


def dequantize_add_(base: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``base += dequantize(q)`` in place, summed in fp32 and rounded once to base's dtype."""
    if base.numel() != q.numel:
        raise ValueError(f"base has {base.numel()} elements but the quantized tensor {q.numel}")
    if q.numel == 0:
        return base
    flat = base.view(-1)
    total = dequantize(q, torch.float32).add_(flat.to(torch.float32))
    flat.copy_(total)
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

    ``scale`` folds the 1/DP of an averaging reduce-scatter into the same pass.
    ``x.numel()`` must be a multiple of the block when a block is given.
    """
    _check(bits, group_size, rounding)
    groups = _grouped_fp32(x, group_size, scale)
    if hadamard_block is not None:
        check_hadamard_group(group_size, hadamard_block)
        if x.numel() % hadamard_block:
            raise ValueError(
                f"{x.numel()} elements is not a multiple of the Hadamard block {hadamard_block}"
            )
        groups = hadamard_transform(groups, hadamard_block)
    return _quantize_groups(groups, bits, rounding, generator, x.numel(), x.dtype)


def _chunk_sum(q: QuantizedTensor, num_chunks: int) -> torch.Tensor:
    """Sum in fp32 of the ``num_chunks`` equal chunks that ``q`` concatenates."""
    if num_chunks <= 0 or q.numel % num_chunks:
        raise ValueError(f"{q.numel} elements cannot be split into {num_chunks} equal chunks")
    chunk = q.numel // num_chunks
    if chunk % q.group_size:
        raise ValueError(
            f"chunk of {chunk} elements is not a multiple of group_size={q.group_size}; "
            "chunks must start on a group boundary"
        )
    return _dequantize_groups(q).view(num_chunks, chunk).sum(dim=0)


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
    _check(bits, group_size, rounding)
    total = _chunk_sum(q, num_chunks)
    groups = _grouped_fp32(total, group_size)
    return _quantize_groups(groups, bits, rounding, generator, total.numel(), q.dtype)


def dequantize_sum(
    q: QuantizedTensor,
    num_chunks: int,
    inverse_hadamard_block: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dequantize k chunks, sum in fp32, then H^-1 per block if asked.

    Returns fp32, or writes (cast) into ``out`` and returns it.
    """
    total = _chunk_sum(q, num_chunks)
    if inverse_hadamard_block is not None:
        total = hadamard_transform(total, inverse_hadamard_block, inverse=True)
    if out is None:
        return total
    if out.numel() != total.numel():
        raise ValueError(f"out has {out.numel()} elements, the sum has {total.numel()}")
    out.view(-1).copy_(total)
    return out
