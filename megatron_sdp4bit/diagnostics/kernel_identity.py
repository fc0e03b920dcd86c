"""Whether the kernels on a device compute bit for bit what the CPU reference does, at
scale: the gradient path (Hadamard quantize, dequantize-sum-requantize, dequantize-sum;
flat, and through the wire buffers with the rows op in a send order) and the weight path
(quantize_weight_diff, dequantize_add_), with nearest rounding, on inputs with many
programs and a partial last tile.

``scripts/gpu_check_triton.py``'s ``large`` step and ``tests/gpu/`` (``-m gpu``) run it
on CUDA; the GPU check's CPU self-test runs it on CPU tensors in Triton's interpreter.
"""
from __future__ import annotations

import torch


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    actual, expected = actual.cpu(), expected.cpu()
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    nan = torch.isnan(expected) if expected.is_floating_point() else torch.zeros_like(expected, dtype=torch.bool)
    return torch.equal(actual.isnan() if actual.is_floating_point() else nan, nan) and torch.equal(
        actual.masked_fill(nan, 0), expected.masked_fill(nan, 0))


def large_path_differences(device: str, chunk: int) -> list:
    """The ops of both paths on ``device`` whose results differ from the CPU reference
    (empty: all bit-identical). ``chunk``: elements per rank, a multiple of 128 that is
    not a power of two (many programs, a partial last tile)."""
    from megatron_sdp4bit.quant import reference as R
    from megatron_sdp4bit.quant import triton_ops as T
    from megatron_sdp4bit.quant.types import QuantizedTensor

    problems = []
    ranks = 4
    gen = torch.Generator().manual_seed(0)
    grads = (torch.randn(ranks * chunk, generator=gen) * torch.rand(ranks * chunk, generator=gen) ** 4)
    grads = grads.to(torch.bfloat16)
    dev_grads = grads.to(device)

    q8 = T.hadamard_quantize(dev_grads, 8, 128, 32, "nearest", scale=1 / ranks)
    r8 = R.hadamard_quantize(grads, 8, 128, 32, "nearest", scale=1 / ranks)
    if not (_same(q8.codes, r8.codes) and _same(q8.scales, r8.scales)):
        problems.append("hadamard_quantize")
    q4 = T.dequantize_sum_requantize(q8, ranks, 4, 128, "nearest")
    r4 = R.dequantize_sum_requantize(r8, ranks, 4, 128, "nearest")
    if not (_same(q4.codes, r4.codes) and _same(q4.scales, r4.scales)):
        problems.append("dequantize_sum_requantize")
    stacked = QuantizedTensor(q4.codes.repeat(2), q4.scales.repeat(2), 4, 128, 2 * q4.numel, q4.dtype)
    out = torch.empty(q4.numel, dtype=torch.bfloat16, device=q4.codes.device)
    T.dequantize_sum(stacked, 2, 32, out=out)
    ref_stacked = QuantizedTensor(r4.codes.repeat(2), r4.scales.repeat(2), 4, 128, 2 * r4.numel, r4.dtype)
    if not _same(out, R.dequantize_sum(ref_stacked, 2, 32).to(torch.bfloat16)):
        problems.append("dequantize_sum")

    main = torch.randn(chunk + 77, generator=gen)
    model = (main + torch.randn(main.shape, generator=gen) * 1e-3).to(torch.bfloat16)
    qw = T.quantize_weight_diff(main.to(device), model.to(device), 4, 2048, "nearest")
    rw = R.quantize_weight_diff(main, model, 4, 2048, "nearest")
    if not (_same(qw.codes, rw.codes) and _same(qw.scales, rw.scales)):
        problems.append("quantize_weight_diff")
    updated = T.dequantize_add_(model.clone().to(device), qw)  # clone: .to(cpu) is no copy
    if not _same(updated, R.dequantize_add_(model.clone(), rw)):
        problems.append("dequantize_add_")
    return problems + _large_wire_path(device, grads, ranks, chunk)


def _same_quantized(actual, expected) -> bool:
    flat = [q.codes.reshape(-1).view(torch.uint8) for q in (actual, expected)]
    return _same(*flat) and _same(actual.scales.reshape(-1), expected.scales.reshape(-1))


def _large_wire_path(device: str, grads: torch.Tensor, ranks: int, chunk: int) -> list:
    """The collectives' wire path: the rows op (send order, a padded chunk) into a
    2-segment send buffer, the requantize between wire views, the last sum."""
    from megatron_sdp4bit.quant import reference as R
    from megatron_sdp4bit.quant import triton_ops as T
    from megatron_sdp4bit.quant.wire import empty_wire

    problems = []
    rows, order = grads.view(ranks, chunk), torch.tensor([2, 0, 3, 1])
    # Columns [128, chunk - 100) padded to chunk - 128: like the last pipeline chunk of an
    # unaligned shard (chunk is a multiple of 128).
    args = (128, chunk - 228, chunk - 128, 8, 128, 32, "nearest")
    sent = T.hadamard_quantize_rows(rows.to(device), order.to(device), *args, scale=1 / ranks,
                                    out=empty_wire(2, 2 * (chunk - 128), 8, 128, device)[1])
    expected = R.hadamard_quantize_rows(rows, order, *args, scale=1 / ranks,
                                        out=empty_wire(2, 2 * (chunk - 128), 8, 128, "cpu")[1])
    if not _same_quantized(sent, expected):
        problems.append("hadamard_quantize_rows")
    out = empty_wire(2, chunk - 128, 4, 128, device)[1]
    T.dequantize_sum_requantize(sent, 2, 4, 128, "nearest", out=out)
    expected = R.dequantize_sum_requantize(expected, 2, 4, 128, "nearest",
                                           out=empty_wire(2, chunk - 128, 4, 128, "cpu")[1])
    if not _same_quantized(out, expected):
        problems.append("dequantize_sum_requantize (wire)")
    if not _same(T.dequantize_sum(out, 2, 32), R.dequantize_sum(expected, 2, 32)):
        problems.append("dequantize_sum (wire)")
    return problems
