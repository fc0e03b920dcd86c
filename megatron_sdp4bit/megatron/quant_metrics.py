"""Cheap, sampled measures of how much the quantizers change what they send.

Both are relative L2 errors on a slice of at most ``SAMPLE`` elements (still
thousands of groups), so logging them every step costs little.
"""
from __future__ import annotations

import math

import torch

from megatron_sdp4bit import quant
from megatron_sdp4bit.config import SDP4BitConfig

SAMPLE = 1 << 16


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (0 when exact is all zeros)."""
    exact = exact.float()
    norm = exact.norm()
    return float((approx.float() - exact).norm() / norm) if norm > 0 else 0.0


def grad_quantization_errors(grad_data: torch.Tensor, config: SDP4BitConfig) -> dict:
    """Relative error of each gradient hop's quantizer on a slice of local gradients.

    A local estimate (no communication): hop 1 quantizes the (Hadamard-rotated)
    local gradients, hop 2 partial sums in the same rotated domain, whose
    statistics are alike. Returns ``{"grad_intra": e1, "grad_inter": e2}`` (empty
    when the buffer is smaller than one group).
    """
    block = config.hadamard_block if config.use_hadamard else None
    align = math.lcm(config.grad_group_size_intra, config.grad_group_size_inter, block or 1)
    n = min(SAMPLE, grad_data.numel()) // align * align
    if n == 0:
        return {}
    x = grad_data.view(-1)[:n].float()
    errors = {}
    for level, bits, group in (("intra", config.effective_grad_bits_intra, config.grad_group_size_intra),
                               ("inter", config.grad_bits_inter, config.grad_group_size_inter)):
        # A private generator: sampling must not move the training's RNG streams.
        gen = torch.Generator(device=x.device).manual_seed(config.seed)
        q = quant.hadamard_quantize(x, bits=bits, group_size=group, hadamard_block=block,
                                    rounding=config.rounding, generator=gen)
        approx = quant.dequantize_sum(q, 1, inverse_hadamard_block=block)
        errors[f"grad_{level}"] = relative_error(approx, x)
    return errors
