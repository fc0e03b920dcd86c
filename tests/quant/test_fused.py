"""Fused reference ops against compositions of the unfused ops, with explicit error bounds.

Each fused op must give exactly what the composition gives (same formulas, same
fp32 roundings, same random stream) and stay within the quantization error bound
of the exact math (computed in fp64).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import hadamard

from megatron_sdp4bit.quant import reference as R
from megatron_sdp4bit.quant import reference_stream as S
from megatron_sdp4bit.quant.hadamard import hadamard_transform
from megatron_sdp4bit.quant.types import QuantizedTensor, qmax

ROUNDINGS = ["nearest", "stochastic"]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(n: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, generator=gen(seed)) * scale).to(dtype)


def assert_same_quantized(a: QuantizedTensor, b: QuantizedTensor) -> None:
    assert (a.bits, a.group_size, a.numel, a.dtype) == (b.bits, b.group_size, b.numel, b.dtype)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales, b.scales)


def scale_per_element(q: QuantizedTensor) -> torch.Tensor:
    return q.scales.double().repeat_interleave(q.group_size)[: q.numel]


def rounding_bound(q: QuantizedTensor, rounding: str, reference: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequantize(q) - reference| (scale/2 nearest, scale stochastic)."""
    factor = 0.5 if rounding == "nearest" else 1.0
    scale = scale_per_element(q)
    return factor * scale + 1e-6 * (reference.abs() + scale * qmax(q.bits))


def received(chunks: list[torch.Tensor], bits: int, group: int, seed: int = 0) -> QuantizedTensor:
    """What an all-to-all delivers: the k senders' quantized chunks, concatenated.

    Chunks start on group boundaries, so quantizing the concatenation is the
    concatenation of the quantized chunks.
    """
    return R.quantize(torch.cat(chunks), bits, group, "stochastic", gen(seed))


def sequential_sum(q: QuantizedTensor, k: int) -> torch.Tensor:
    values = R.dequantize(q, torch.float32).view(k, -1)
    total = values[0].clone()
    for c in range(1, k):
        total += values[c]
    return total


# --- quantize_weight_diff -----------------------------------------------------------

@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_quantize_weight_diff_is_quantize_of_the_difference(model_dtype, rounding):
    n = 5000  # not a multiple of the group
    model = randn(n, 1, model_dtype)
    main = model.float() + randn(n, 2, scale=1e-3)
    fused = R.quantize_weight_diff(main, model, 4, 2048, rounding, gen(3))
    diff = main - model.float()
    assert_same_quantized(fused, R.quantize(diff, 4, 2048, rounding, gen(3)))
    error = (R.dequantize(fused).double() - (main.double() - model.double())).abs()
    # main - model in fp32 rounds once (relative 2^-24) before quantization.
    bound = rounding_bound(fused, rounding, diff.double()) + 2.0**-24 * diff.double().abs()
    assert bool((error <= bound).all())


# --- dequantize_add_ ----------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("base_dtype", [torch.bfloat16, torch.float32])
def test_dequantize_add_rounds_the_fp32_sum_once(base_dtype, bits):
    n = 3001
    base = randn(n, 4, base_dtype)
    q = R.quantize(randn(n, 5, scale=1e-2), bits, 64, "stochastic", gen(6))
    expected = (base.float() + R.dequantize(q, torch.float32)).to(base_dtype)
    result = R.dequantize_add_(base, q)
    assert result is base
    assert torch.equal(base, expected)
    exact = base.double()  # now the result; compare to the exact fp64 sum
    exact_sum = randn(n, 4, base_dtype).double() + R.dequantize(q, torch.float32).double()
    unit = 2.0**-8 if base_dtype == torch.bfloat16 else 2.0**-23  # one ulp, relative
    assert bool(((exact - exact_sum).abs() <= unit * exact_sum.abs()).all())


def test_dequantize_add_into_a_shaped_base():
    base = torch.zeros(4, 6, dtype=torch.bfloat16)
    q = R.quantize(torch.arange(24.0), 8, 8, "nearest")
    R.dequantize_add_(base, q)
    assert torch.equal(base.view(-1), R.dequantize(q, torch.float32).to(torch.bfloat16))


# --- hadamard_quantize ---------------------------------------------------------------

@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group,block,scale", [
    (8, 128, 32, 0.25), (4, 128, 32, 1.0), (8, 64, 64, 0.5), (2, 256, 2, 1 / 3), (8, 128, None, 0.5),
])
def test_hadamard_quantize_is_quantize_of_the_scaled_transform(bits, group, block, scale,
                                                               dtype, rounding):
    n = 20 * group + 64  # a partial last group
    x = randn(n, 7, dtype, scale=4.0)
    x[5] = 300.0  # an outlier the transform spreads over its block
    fused = R.hadamard_quantize(x, bits, group, block, rounding, gen(8), scale=scale)
    scaled = x.float() * scale
    transformed = scaled if block is None else hadamard_transform(scaled, block)
    composed = R.quantize(transformed, bits, group, rounding, gen(8))
    assert fused.dtype == dtype and fused.numel == n
    assert torch.equal(fused.codes, composed.codes) and torch.equal(fused.scales, composed.scales)
    # Against the exact transform (fp64, scipy's matrix): rounding bound plus the
    # fp32 error of scaling (fp32(scale) and the product: 2 * 2^-24 relative) and
    # of the butterfly (log2(block) roundings per output).
    exact_scaled = x.double() * scale
    if block is None:
        exact, fp32_error = exact_scaled, 2.0**-23 * exact_scaled.abs()
    else:
        rows = exact_scaled.numpy().reshape(-1, block)
        exact = torch.from_numpy((rows @ hadamard(block).T).reshape(-1))
        block_abs = torch.from_numpy(np.abs(rows).sum(axis=1)).repeat_interleave(block)
        fp32_error = (np.log2(block) + 2) * 2.0**-24 * block_abs
    error = (R.dequantize(fused, torch.float32).double() - exact).abs()
    assert bool((error <= rounding_bound(fused, rounding, exact) + fp32_error).all())


# --- dequantize_sum_requantize --------------------------------------------------------

@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("in_bits,in_group,bits,group,k", [
    (8, 128, 4, 128, 4), (8, 96, 4, 64, 3), (4, 32, 2, 8, 1), (8, 128, 8, 512, 2), (2, 16, 4, 48, 5),
])
def test_dequantize_sum_requantize_is_quantize_of_the_chunk_sum(in_bits, in_group, bits, group,
                                                                k, rounding):
    chunk = 6 * in_group
    q = received([randn(chunk, 10 + c) for c in range(k)], in_bits, in_group)
    fused = R.dequantize_sum_requantize(q, k, bits, group, rounding, gen(11))
    total = sequential_sum(q, k)
    assert_same_quantized(fused, R.quantize(total, bits, group, rounding, gen(11)))
    # Against the exact sum of what was received (fp64): the fp32 sum of k terms
    # rounds k - 1 times.
    values = R.dequantize(q, torch.float32).double().view(k, -1)
    exact = values.sum(dim=0)
    sum_error = (k - 1) * 2.0**-24 * values.abs().sum(dim=0)
    error = (R.dequantize(fused, torch.float32).double() - exact).abs()
    assert bool((error <= rounding_bound(fused, rounding, exact) + sum_error).all())


@settings(max_examples=25)
@given(k=st.integers(1, 6), in_group=st.sampled_from([8, 24, 64, 96]),
       group=st.sampled_from([8, 16, 40, 128]), groups_per_chunk=st.integers(1, 9),
       chunk_elements=st.sampled_from([8, 64, 200, 1 << 18]))
def test_requantize_is_independent_of_the_cache_chunking(k, in_group, group, groups_per_chunk,
                                                          chunk_elements):
    chunk = groups_per_chunk * in_group
    q = received([randn(chunk, 20 + c) for c in range(k)], 8, in_group)
    expected = R.quantize(sequential_sum(q, k), 4, group, "stochastic", gen(1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(S, "CPU_CHUNK_ELEMENTS", chunk_elements)
        actual = R.dequantize_sum_requantize(q, k, 4, group, "stochastic", gen(1))
        assert torch.equal(R.dequantize_sum(q, k), sequential_sum(q, k))
    # Every group here is a multiple of 4 elements (one 64-bit random draw), so
    # the noise stream is consumed identically however the work is chunked.
    assert_same_quantized(actual, expected)


# --- dequantize_sum (+ inverse Hadamard) ------------------------------------------------

@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, 32, 128])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_dequantize_sum_is_the_chunk_sum_then_the_inverse_transform(k, block, out_dtype):
    chunk = 5 * 128
    q = received([randn(chunk, 30 + c) for c in range(k)], 4, 128)
    total = sequential_sum(q, k)
    expected = total if block is None else hadamard_transform(total, block, inverse=True)
    if out_dtype is None:
        result = R.dequantize_sum(q, k, block)
        assert result.dtype == torch.float32 and torch.equal(result, expected)
    else:
        out = torch.full((5, 128), 7.0, dtype=out_dtype)
        assert R.dequantize_sum(q, k, block, out=out) is out
        assert torch.equal(out.view(-1), expected.to(out_dtype))


@pytest.mark.parametrize("k", [2, 4])
def test_the_gradient_pipeline_recovers_the_sum_within_its_error_bound(k):
    """k senders: H(x/k) 8-bit -> sum -> H^-1 equals mean(x) within the stated bound.

    In the transformed domain each sender's error is <= its scale/2 (nearest);
    their sum is <= sum_c scale_c/2; H^-1 = H/block averages a block of such
    errors with weights +-1/block, so it stays <= sum_c max-scale-in-block_c / 2.
    """
    block, group, chunk = 32, 128, 1024
    xs = [randn(chunk, 40 + c, scale=1.0 + c) for c in range(k)]
    parts = [R.hadamard_quantize(x, 8, group, block, "nearest", scale=1.0 / k) for x in xs]
    buffer = QuantizedTensor(codes=torch.cat([p.codes for p in parts]),
                             scales=torch.cat([p.scales for p in parts]), bits=8,
                             group_size=group, numel=k * chunk)
    result = R.dequantize_sum(buffer, k, inverse_hadamard_block=block).double()
    exact = sum(x.double() for x in xs) / k
    per_sender = [scale_per_element(p).view(-1, block).amax(dim=1) for p in parts]
    bound = (sum(per_sender) / 2).repeat_interleave(block)
    slack = 1e-4 * max(float(x.abs().max()) for x in xs)  # fp32 transform and sums
    assert bool(((result - exact).abs() <= bound + slack).all())


# --- empty tensors ---------------------------------------------------------------------

def test_fused_ops_on_empty_tensors():
    empty = torch.empty(0)
    q = R.quantize_weight_diff(empty, empty.to(torch.bfloat16), 4, 64)
    assert q.numel == 0 and q.codes.numel() == 0
    assert R.hadamard_quantize(empty, 8, 128, 32).numel == 0
    assert R.dequantize_add_(empty.clone(), q).numel() == 0
    assert R.dequantize_sum(q, 2, 32).shape == (0,)
    assert R.dequantize_sum_requantize(q, 2, 4, 64).numel == 0
