"""The torch reference quantizer against the contract, an independent numpy model of it,
and statistical bounds for stochastic rounding."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_sdp4bit import quant
from megatron_sdp4bit.quant import reference as R
from megatron_sdp4bit.quant import reference_stream as S
from megatron_sdp4bit.quant.packing import unpack_codes
from megatron_sdp4bit.quant.types import qmax


# --- an independent model of the contract (numpy, fp32 arithmetic) ---------------------

def contract_nearest(x: torch.Tensor, bits: int, group: int):
    """(codes [groups, group], scales) by the frozen formulas, computed in numpy fp32."""
    flat = x.reshape(-1).to(torch.float32).numpy()
    padded = np.zeros(-(-flat.size // group) * group, dtype=np.float32)
    padded[: flat.size] = flat
    rows = padded.reshape(-1, group)
    levels = qmax(bits)
    with np.errstate(all="ignore"):
        scales = (np.abs(rows).max(axis=1, initial=0) / np.float32(levels)).astype(np.float32)
        usable = np.isfinite(scales) & (scales > 0)
        inv = np.where(usable, np.float32(1) / scales, np.float32(0)).astype(np.float32)
        v = rows * inv[:, None]
        codes = np.clip(np.floor(v + np.float32(0.5)), -levels - 1, levels)
    codes = np.nan_to_num(codes, nan=0.0)
    codes[~usable] = 0
    return codes.astype(np.int8), scales


def codes_of(q) -> np.ndarray:
    return unpack_codes(q.codes, q.bits, q.padded_numel).numpy().reshape(-1, q.group_size)


def group_scales_per_element(q) -> torch.Tensor:
    return q.scales.double().repeat_interleave(q.group_size)[: q.numel]


# --- round trip over random shapes, dtypes, bits and group sizes -----------------------

@st.composite
def quantize_cases(draw):
    bits = draw(st.sampled_from([2, 4, 8]))
    width = 8 // bits
    group = width * draw(st.integers(1, 80))
    shape = draw(st.lists(st.integers(0, 37), min_size=1, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    exponent_spread = draw(st.sampled_from([0.0, 3.0, 20.0]))
    return bits, group, tuple(shape), dtype, seed, exponent_spread


def random_input(shape, dtype, seed, exponent_spread=0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if exponent_spread:
        x = x * torch.exp2(torch.randn(shape, generator=gen) * exponent_spread).clamp(max=2.0**60)
    return x.to(dtype)


@settings(max_examples=60)
@given(quantize_cases())
def test_nearest_round_trip_error_is_at_most_half_a_scale(case):
    bits, group, shape, dtype, seed, spread = case
    x = random_input(shape, dtype, seed, spread)
    q = R.quantize(x, bits, group, "nearest")
    # Bit for bit what the independent model of the formulas gives.
    codes, scales = contract_nearest(x, bits, group)
    assert np.array_equal(q.scales.numpy(), scales)
    assert np.array_equal(codes_of(q), codes)
    assert q.numel == x.numel() and q.dtype == dtype
    back = R.dequantize(q, torch.float32).double()
    exact = x.reshape(-1).double()  # bf16 -> fp64 is exact
    scale = group_scales_per_element(q)
    # fp32 slack: v = x * inv and code * scale each round once (relative 2^-24).
    slack = 1e-6 * (exact.abs() + scale * qmax(bits))
    assert bool(((back - exact).abs() <= scale / 2 + slack).all())
    assert R.dequantize(q).dtype == dtype


@settings(max_examples=40)
@given(quantize_cases())
def test_stochastic_round_trip_error_is_below_one_scale(case):
    bits, group, shape, dtype, seed, spread = case
    x = random_input(shape, dtype, seed, spread)
    q = R.quantize(x, bits, group, "stochastic", torch.Generator().manual_seed(seed))
    assert np.array_equal(q.scales.numpy(), contract_nearest(x, bits, group)[1])
    back = R.dequantize(q, torch.float32).double()
    exact = x.reshape(-1).double()
    scale = group_scales_per_element(q)
    slack = 1e-6 * (exact.abs() + scale * qmax(bits))
    assert bool(((back - exact).abs() < scale + slack).all())


def test_chunking_does_not_change_the_result(monkeypatch):
    """Cache-sized chunks are an implementation detail: same bits, same random stream."""
    x = random_input((3, 5000), torch.float32, seed=3, exponent_spread=3.0)
    x[1, 17] = float("nan")
    whole = [R.quantize(x, 4, 64, rounding, torch.Generator().manual_seed(1))
             for rounding in ("nearest", "stochastic")]
    monkeypatch.setattr(S, "CPU_CHUNK_ELEMENTS", 256)  # 4 groups per chunk
    chunked = [R.quantize(x, 4, 64, rounding, torch.Generator().manual_seed(1))
               for rounding in ("nearest", "stochastic")]
    for a, b in zip(whole, chunked):
        assert torch.equal(a.codes, b.codes)
        assert torch.equal(a.scales.nan_to_num(-1.0), b.scales.nan_to_num(-1.0))


def test_worker_threads_do_not_change_the_result(monkeypatch):
    """Chunks run on as many threads as torch may use; the bits must not depend on it."""
    monkeypatch.setattr(S, "CPU_CHUNK_ELEMENTS", 512)  # many chunks
    x = random_input((40_960,), torch.float32, seed=8)  # 4 chunks of 80 groups of 128

    def run_all():
        q = R.quantize(x, 4, 128, "stochastic", torch.Generator().manual_seed(2))
        h = R.hadamard_quantize(x, 8, 128, 32, "stochastic", torch.Generator().manual_seed(3))
        base = x.to(torch.bfloat16)
        R.dequantize_add_(base, q)
        return [q.codes, q.scales, h.codes, h.scales, R.dequantize(q), base,
                R.dequantize_sum(h, 4, 32),
                R.dequantize_sum_requantize(h, 4, 4, 64, "stochastic", torch.Generator().manual_seed(4)).codes]

    before = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results[threads] = run_all()
            assert torch.get_num_threads() == threads  # the caller's setting is restored
    finally:
        torch.set_num_threads(before)
    for single, several in zip(results[1], results[3]):
        assert torch.equal(single, several)


# --- stochastic rounding: unbiased within the documented bound, reproducible ---------------

def test_stochastic_bias_is_within_the_documented_bound_for_every_noise_value():
    """Exact expectation: feed each of the 256 noise values once to every test value.

    The mean code must be rne(256 v) / 256 exactly (the proof in reference.py), so
    within 2^-9 of v, with the bound attained where 256 v is an odd multiple of 1/2.
    Test values include the worst places: just below and above integers and
    half-integers, odd multiples of 2^-9, and magnitudes up to qmax.
    """
    noise = torch.arange(256, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        levels = qmax(bits)
        centres = torch.tensor(sorted({-levels, -levels + 1, -(levels // 2), -1, 0, 1,
                                       levels // 2, levels - 1, levels}), dtype=torch.float32)
        offsets = torch.tensor([0.0, 2.0**-20, -(2.0**-20), 2.0**-9, -(2.0**-9), 3 * 2.0**-9,
                                0.5, 0.5 - 2.0**-18, 0.3, 0.7])
        v = (centres[:, None] + offsets[None, :]).reshape(-1)
        v = torch.cat([v, (torch.rand(64, generator=gen) * 2 - 1) * levels]).clamp(-levels, levels)
        scaled = v[:, None].repeat(1, noise.numel())
        codes = _stochastic(scaled, noise.expand_as(scaled).contiguous())
        mean = codes.mean(dim=1)
        grid = torch.round(v.double() * 256) / 256  # rne(256 v) / 256 (torch.round: ties to even)
        assert torch.equal(mean, grid), bits
        low = v.double().floor()[:, None]  # every code is floor(v) or floor(v) + 1
        assert bool(((codes == low) | (codes == low + 1)).all())
        bias = (mean - v.double()).abs().max().item()
        assert bias <= R.STOCHASTIC_BIAS_BOUND[bits] == 2.0**-9, (bits, bias)
    one = torch.full((1, 256), 2.0**-9)  # 256 v = 1/2: rounds to 0, bias exactly 2^-9
    assert _stochastic(one, noise.view(1, -1)).mean() == 0.0


def _stochastic(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The reference's stochastic codes of v (inv = 1) with noise k, as fp64."""
    wide, out = torch.empty(v.shape, dtype=torch.float64), torch.empty(v.shape, dtype=torch.int32)
    return S.stochastic_codes(v, torch.ones(v.shape[0]), k, wide, out).double()


def test_stochastic_rounding_uses_the_exact_product():
    # x * inv rounded to fp32 lands on 1/512 (256 v = 1/2, a tie: rne gives 0); the exact
    # product lies just above it, so rne(256 x inv) is 1: only k = 255 carries.
    x = torch.tensor([[3.0]])
    inv = torch.tensor([1.0]) / 1536  # fp32(1/1536) is above 1/1536
    assert float((x * inv.unsqueeze(1)).squeeze()) == 2.0**-9 < 3.0 * float(inv)
    k = torch.arange(256, dtype=torch.int32).view(1, -1)
    codes = S.stochastic_codes(x.expand(1, 256).contiguous(), inv, k,
                               torch.empty(1, 256, dtype=torch.float64),
                               torch.empty(1, 256, dtype=torch.int32))
    assert int(codes.sum()) == 1


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rounding_is_unbiased_over_many_draws(bits):
    """Mean error over D seeded draws of n elements, relative to each group's scale.

    Each normalised error e = code - v lies in (-1, 1) with variance <= 1/4, so the
    mean of the n*D independent errors has standard deviation <= 1/(2 sqrt(n D)):
    we allow 5 of those plus the documented deterministic bias. Per element, the
    mean over D draws gets 5 standard deviations of 1/(2 sqrt(D)) plus the bias.
    """
    n, group, draws = 4096, 128, 400
    x = random_input((n,), torch.float32, seed=bits)
    gen = torch.Generator().manual_seed(1234)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws):
        q = R.quantize(x, bits, group, "stochastic", gen)
        total += R.dequantize(q, torch.float32).double()
    scale = group_scales_per_element(q)
    normalised_mean_error = (total / draws - x.double()) / scale
    bias = R.STOCHASTIC_BIAS_BOUND[bits]
    overall_bound = 5 / (2 * math.sqrt(n * draws)) + bias
    assert abs(normalised_mean_error.mean().item()) <= overall_bound
    per_element_bound = 5 / (2 * math.sqrt(draws)) + bias
    assert normalised_mean_error.abs().max().item() <= per_element_bound


def test_stochastic_rounding_detects_a_biased_rounder():
    """The statistical test above has teeth: floor(v + 0.45 + ...) fails it."""
    n, draws = 4096, 400
    v = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 6 - 3
    gen = torch.Generator().manual_seed(1)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws):
        u = torch.rand(n, generator=gen) * 0.95  # biased: u ~ U[0, 0.95)
        total += torch.floor(v + u).double()
    mean_error = (total / draws - v.double()).mean().item()
    assert abs(mean_error) > 5 / (2 * math.sqrt(n * draws)) + R.STOCHASTIC_BIAS_BOUND[4]


def test_stochastic_rounding_is_reproducible_from_the_generator_seed():
    x = random_input((10_000,), torch.bfloat16, seed=9)
    a = R.quantize(x, 4, 2048, "stochastic", torch.Generator().manual_seed(42))
    b = R.quantize(x, 4, 2048, "stochastic", torch.Generator().manual_seed(42))
    c = R.quantize(x, 4, 2048, "stochastic", torch.Generator().manual_seed(43))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.codes, c.codes)
    torch.manual_seed(7)
    d = R.quantize(x, 4, 2048, "stochastic")  # the default generator
    torch.manual_seed(7)
    assert torch.equal(d.codes, R.quantize(x, 4, 2048, "stochastic").codes)


def test_stochastic_codes_are_floor_or_ceil_of_v():
    x = random_input((5000,), torch.float32, seed=5)
    q = R.quantize(x, 4, 256, "stochastic", torch.Generator().manual_seed(5))
    codes, scales = contract_nearest(x, 4, 256)
    rows = np.zeros(q.padded_numel, dtype=np.float32)
    rows[: x.numel()] = x.numpy()
    v = rows.reshape(-1, 256) * (np.float32(1) / scales)[:, None]
    got = codes_of(q)
    assert np.all((got == np.floor(v)) | (got == np.floor(v) + 1))


# --- special values and empty tensors -----------------------------------------------

@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_zero_groups_dequantize_to_exact_zeros(bits, rounding):
    x = random_input((4, 64), torch.float32, seed=1)
    x[2] = 0.0
    q = R.quantize(x, bits, 64, rounding, torch.Generator().manual_seed(0))
    assert q.scales[2].item() == 0.0
    back = R.dequantize(q).view(4, 64)
    assert torch.equal(back[2], torch.zeros(64)) and not back[2].signbit().any()
    assert bool(torch.isfinite(back).all())


@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_nan_or_inf_poisons_only_its_own_group(bits, rounding, special):
    x = random_input((6, 32), torch.float32, seed=2)
    clean = x.clone()
    clean[3] = 0.0
    x[3, 5] = special
    q = R.quantize(x, bits, 32, rounding, torch.Generator().manual_seed(0))
    back = R.dequantize(q).view(6, 32)
    assert not bool(torch.isfinite(back[3]).any())  # the whole group is non-finite
    assert bool((codes_of(q)[3] == 0).all())
    others = [0, 1, 2, 4, 5]
    reference = R.quantize(clean, bits, 32, rounding, torch.Generator().manual_seed(0))
    assert torch.equal(q.scales[others], reference.scales[others])
    if rounding == "nearest":  # stochastic: same noise stream, so the same codes too
        assert torch.equal(back[others], R.dequantize(reference).view(6, 32)[others])
    assert np.array_equal(codes_of(q)[others], codes_of(reference)[others])


def test_nan_at_every_position_of_a_group_is_caught():
    # The absmax reductions are vectorised: NaN must propagate from any lane.
    for position in range(0, 2048, 97):
        x = torch.ones(2048)
        x[position] = float("nan")
        assert math.isnan(R.quantize(x, 4, 2048, "nearest").scales.item())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_groups_whose_inverse_scale_overflows_are_unusable_and_dequantize_to_zeros(rounding):
    x = torch.zeros(16)
    x[:4] = torch.tensor([1e-39, -1e-39, 5e-40, 0.0])  # subnormal: 7 / absmax overflows
    x[8:] = 1.0
    q = R.quantize(x, 4, 8, rounding, torch.Generator().manual_seed(0))
    codes = codes_of(q)
    assert math.isinf(q.scales[0].reciprocal().item())  # in fp32
    assert codes[0].tolist() == [0] * 8
    assert codes[1].tolist() == [7] * 8
    back = R.dequantize(q)
    assert torch.equal(back[:8], torch.zeros(8)) and torch.equal(back[8:], torch.ones(8))
    # The smallest usable scale: 1/scale just finite, the group quantized as usual.
    y = torch.full((8,), 7 * 2.0**-127)
    assert codes_of(R.quantize(y, 4, 8, rounding, torch.Generator().manual_seed(0)))[0].tolist() == [7] * 8


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_empty_tensors(bits):
    for dtype in (torch.float32, torch.bfloat16):
        q = R.quantize(torch.empty(0, dtype=dtype), bits, 64)
        assert q.numel == 0 and q.codes.numel() == 0 and q.scales.numel() == 0
        assert q.codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
        assert R.dequantize(q).shape == (0,) and R.dequantize(q).dtype == dtype


def test_non_contiguous_input_is_read_in_logical_order():
    x = random_input((64, 48), torch.float32, seed=4).t()
    assert not x.is_contiguous()
    a = R.quantize(x, 4, 32, "nearest")
    b = R.quantize(x.contiguous(), 4, 32, "nearest")
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


def test_the_dispatching_api_uses_the_reference_on_cpu():
    assert quant.backend_for(torch.zeros(1)) is R
    x = random_input((300,), torch.float32, seed=6)
    assert torch.equal(quant.quantize(x, 4, 64, "nearest").codes, R.quantize(x, 4, 64, "nearest").codes)


# --- bad arguments: ValueError naming what to change -------------------------------------

@pytest.mark.parametrize("call,message", [
    (lambda: R.quantize(torch.ones(8), bits=3), r"bits=3 is not supported; use one of \(2, 4, 8\)"),
    (lambda: R.quantize(torch.ones(8), group_size=0), "group_size=0 must be a positive multiple of 2"),
    (lambda: R.quantize(torch.ones(8), 2, group_size=6), "group_size=6 must be a positive multiple of 4"),
    (lambda: R.quantize(torch.ones(8), 4, group_size=-2), "positive multiple"),
    (lambda: R.quantize(torch.ones(8), rounding="up"), "use 'nearest' or 'stochastic'"),
    (lambda: R.hadamard_quantize(torch.ones(128), 8, 128, hadamard_block=24),
     "must be a power of two between 2 and 256"),
    (lambda: R.hadamard_quantize(torch.ones(192), 8, 96, hadamard_block=64),
     "group_size=96 is not a multiple of the Hadamard block 64"),
    (lambda: R.hadamard_quantize(torch.ones(100), 8, 128, hadamard_block=32),
     "100 elements is not a multiple of the Hadamard block 32"),
    (lambda: R.quantize_weight_diff(torch.ones(8), torch.ones(9)), "main shard has 8 elements"),
    (lambda: R.dequantize_add_(torch.ones(9), R.quantize(torch.ones(8), 4, 8)), "base has 9 elements"),
    (lambda: R.dequantize_sum(R.quantize(torch.ones(24), 4, 8), 5), "cannot be split into 5"),
    (lambda: R.dequantize_sum(R.quantize(torch.ones(24), 4, 8), 2), "not a multiple of group_size=8"),
    (lambda: R.dequantize_sum(R.quantize(torch.ones(48), 4, 8), 2, 16),
     "24 elements is not a multiple of block=16"),
    (lambda: R.dequantize_sum(R.quantize(torch.ones(48), 4, 8), 2, out=torch.empty(5)),
     "out has 5 elements, the sum has 24"),
    (lambda: R.dequantize_sum_requantize(R.quantize(torch.ones(48), 4, 8), 0), "into 0 equal chunks"),
])
def test_bad_arguments_raise_value_errors_that_say_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()
