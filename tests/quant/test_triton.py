"""Triton kernels (quant/triton_ops.py) against the torch reference, the specification.

Where the kernels run:
- CPU (default): in Triton's interpreter. Triton must be *imported* with
  TRITON_INTERPRET=1 for that (its own library functions, tl.max and friends,
  are decorated at import), and in a pytest session something else may already
  have imported it compiled. So a plain run of this file keeps two tests: one
  re-runs this file in a fresh interpreter process (TRITON_INTERPRET=1) where
  all the kernel tests run, one compiles every kernel for sm_90 (no GPU needed).
- ``TRITON_INTERPRET=1 pytest tests/quant/test_triton.py``: the kernel tests,
  in this process (what the re-run does).
- ``SDP4BIT_TRITON_TEST_DEVICE=cuda``: the kernel tests on CUDA tensors with
  compiled kernels (scripts/gpu_check_triton.py does that).

Nearest rounding must match the reference bit for bit (codes and scales; values
of the dequantizing ops), up to the sign of zero (see assert_same_values). The reference always runs on CPU copies: torch on
CUDA divides by a scalar through its reciprocal, which is not the contract.
Stochastic rounding is checked by its definition instead: each code is floor(v)
or floor(v) + 1, the mean over draws is v within a Hoeffding bound, and a seed
reproduces the draw.
"""
from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from megatron_sdp4bit.quant import reference as R  # noqa: E402
from megatron_sdp4bit.quant.hadamard import hadamard_transform  # noqa: E402
from megatron_sdp4bit.quant.types import QuantizedTensor, qmax  # noqa: E402
from triton_cases import (  # noqa: E402
    DEVICE,
    KERNELS_HERE,
    assert_same_quantized,
    assert_same_values,
    awkward_input,
    codes_of,
    few_large_programs,  # noqa: F401  (an autouse fixture)
    on_cpu,
    on_device,
    received_buffer,
)

# The interpreter computes with numpy, which warns about the NaN/Inf the tests feed it.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL_TEST_FILES = ("test_triton.py", "test_triton_chunks.py", "test_triton_offsets.py")


def _python_env(**changes) -> dict:
    path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **changes)


if KERNELS_HERE:
    from triton_cases import T, launch_plan

    import triton
    import triton.language as tl

    from megatron_sdp4bit.quant.triton_kernels.noise import philox2x32

    @triton.jit
    def _philox_kat_kernel(inputs_ptr, out_ptr):
        """Three (counter, counter, key) triples in, their Philox-2x32-10 words out."""
        i = tl.arange(0, 4)
        c0 = tl.load(inputs_ptr + 3 * i, mask=i < 3, other=0).to(tl.uint32)
        c1 = tl.load(inputs_ptr + 3 * i + 1, mask=i < 3, other=0).to(tl.uint32)
        key = tl.load(inputs_ptr + 3 * i + 2, mask=i < 3, other=0).to(tl.uint32)
        w0, w1 = philox2x32(c0, c1, key)
        tl.store(out_ptr + 2 * i, w0.to(tl.int64), mask=i < 3)
        tl.store(out_ptr + 2 * i + 1, w1.to(tl.int64), mask=i < 3)



# --- nearest rounding: bit-identical to the reference ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [8, 96, 2048])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_nearest_is_bit_identical(bits, group, dtype):
    x = awkward_input(9 * group - 3, group, bits, dtype, seed=bits + group)
    expected = R.quantize(x.cpu(), bits, group, "nearest")
    assert_same_quantized(T.quantize(x, bits, group, "nearest"), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_other_input_dtypes_and_strided_inputs_match(dtype):
    x = (awkward_input(2 * 256 * 3, 64, 4, specials=False, seed=1) * 100).to(dtype)
    strided = x.view(-1, 2)[:, 1]  # every other element: not contiguous
    for t in (x, strided):
        assert_same_quantized(T.quantize(t, 4, 64, "nearest"), R.quantize(t.cpu(), 4, 64, "nearest"))


@pytest.mark.parametrize("numel", [5 * 1024 - 32, 4 * 1024])  # with and without a tail
@pytest.mark.parametrize("hadamard_block", [None, 32])
@pytest.mark.parametrize("bits", [4, 8])
def test_group_larger_than_a_program_is_sliced_and_still_identical(bits, hadamard_block, numel):
    x = awkward_input(numel, 1024, bits, seed=3)
    with launch_plan.tuning(max_group_block=256):
        actual = T.hadamard_quantize(x, bits, 1024, hadamard_block, "nearest", scale=0.25)
    expected = R.hadamard_quantize(x.cpu(), bits, 1024, hadamard_block, "nearest", scale=0.25)
    assert_same_quantized(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantize_is_bit_identical(bits, dtype):
    q = R.quantize(awkward_input(7 * 96 + 5, 96, bits, seed=bits).cpu(), bits, 96, "nearest")
    assert_same_values(T.dequantize(on_device(q), dtype), R.dequantize(q, dtype))
    assert T.dequantize(on_device(q)).dtype == torch.float32  # q.dtype by default


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,group", [(4, 2048), (8, 96)])
def test_weight_diff_and_apply_are_bit_identical(bits, group, model_dtype):
    main = awkward_input(3 * group + 1, group, bits, seed=7)
    model = (main * 0.999).to(model_dtype)
    q = T.quantize_weight_diff(main, model, bits, group, "nearest")
    expected = R.quantize_weight_diff(main.cpu(), model.cpu(), bits, group, "nearest")
    assert_same_quantized(q, expected)
    applied = T.dequantize_add_(model.clone(), q)
    assert_same_values(applied, R.dequantize_add_(model.cpu().clone(), expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,block,scale", [(128, 32, 1.0), (96, 32, 1 / 3), (64, 2, 0.5),
                                               (256, 256, 1 / 7), (128, None, 1 / 3)])
def test_hadamard_quantize_is_bit_identical(group, block, scale, dtype):
    # The butterfly does the reference's fp32 additions in the reference's order,
    # so even the transform is exact: no tolerance needed.
    x = awkward_input(4 * group + (block or 2) * 3, group, 8, dtype, seed=group)
    for bits in (8, 4):
        actual = T.hadamard_quantize(x, bits, group, block, "nearest", scale=scale)
        expected = R.hadamard_quantize(x.cpu(), bits, group, block, "nearest", scale=scale)
        assert_same_quantized(actual, expected)


@pytest.mark.parametrize("in_bits,in_group,bits,group,chunks", [
    (8, 128, 4, 128, 4), (8, 64, 4, 96, 3), (4, 32, 2, 8, 1), (8, 128, 8, 128, 8),
    (2, 16, 8, 64, 16)])
def test_dequantize_sum_requantize_is_bit_identical(in_bits, in_group, bits, group, chunks):
    q = received_buffer(chunks, 4 * in_group, in_bits, in_group, seed=chunks)
    actual = T.dequantize_sum_requantize(q, chunks, bits, group, "nearest")
    expected = R.dequantize_sum_requantize(on_cpu(q), chunks, bits, group, "nearest")
    assert_same_quantized(actual, expected)


@pytest.mark.parametrize("in_bits,in_group,bits,group,chunk,tiling", [
    (4, 16, 4, 1000, 2400, dict(max_group_block=256)),  # sliced, group not a multiple of 256
    (8, 128, 8, 1024, 2 * 1024 + 256, dict(max_group_block=256)),  # sliced, whole slices
    (2, 16, 4, 192, 3 * 192 + 16, dict(tile_elements=256)),  # one group per program, 256 > 192
    (8, 8, 2, 12, 96, dict(tile_elements=256)),  # 16 groups of 12 per program (rows not adjacent)
])
def test_dequantize_sum_requantize_tilings_are_bit_identical(in_bits, in_group, bits, group,
                                                             chunk, tiling):
    # The received chunks are read as contiguous runs (code_runs.py) where the tile
    # is one; each of these tilings reaches a different branch of that choice.
    q = received_buffer(2, chunk, in_bits, in_group, seed=group)
    with launch_plan.tuning(**tiling):
        actual = T.dequantize_sum_requantize(q, 2, bits, group, "nearest")
    expected = R.dequantize_sum_requantize(on_cpu(q), 2, bits, group, "nearest")
    assert_same_quantized(actual, expected)


def _sequential_chunk_sum(q: QuantizedTensor, chunks: int) -> torch.Tensor:
    """fp32 sum of the chunks in order 0..k-1, one addition at a time."""
    values = R.dequantize(on_cpu(q), torch.float32).view(chunks, -1)
    total = values[0].clone()
    for c in range(1, chunks):
        total += values[c]
    return total


def test_many_chunks_are_summed_in_chunk_order():
    # Chunk 0, then 1, 2, ...: checked against a plain loop as well as the reference
    # (torch's own sum(dim=0) would use a cascaded order beyond 16 rows).
    chunks, bits, group = 32, 8, 128
    q = received_buffer(chunks, 2 * group, bits, group, seed=11)
    total = _sequential_chunk_sum(q, chunks)
    assert_same_values(T.dequantize_sum(q, chunks), total)
    assert_same_values(R.dequantize_sum(on_cpu(q), chunks), total)
    expected = R.quantize(total, 4, group, "nearest")
    actual = T.dequantize_sum_requantize(q, chunks, 4, group, "nearest")
    assert torch.equal(actual.codes.cpu(), expected.codes)
    assert_same_values(actual.scales, expected.scales)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [None, 32])
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_dequantize_sum_is_bit_identical(chunks, block, out_dtype):
    q = received_buffer(chunks, 3 * 128, 4, 128, seed=chunks)
    expected = R.dequantize_sum(on_cpu(q), chunks, block)
    if out_dtype is None:
        assert_same_values(T.dequantize_sum(q, chunks, block), expected)
        return
    out = torch.full((3 * 128,), 5.0, dtype=out_dtype, device=DEVICE)
    assert T.dequantize_sum(q, chunks, block, out=out) is out
    assert_same_values(out, expected.to(out_dtype))
    strided = torch.zeros(2, 3 * 128, dtype=out_dtype, device=DEVICE)[:, ::2].T  # not contiguous
    T.dequantize_sum(q, chunks, block, out=strided)
    assert_same_values(strided.reshape(-1), expected.to(out_dtype))


def test_received_8bit_bytes_may_be_uint8():
    q = received_buffer(2, 256, 8, 128)
    as_bytes = QuantizedTensor(q.codes.view(torch.uint8), q.scales, 8, 128, q.numel)
    assert_same_values(T.dequantize_sum(as_bytes, 2), T.dequantize_sum(q, 2))


def test_empty_inputs_give_empty_results():
    empty = torch.empty(0, device=DEVICE)
    for q, ref in [(T.quantize(empty, 4, 64), R.quantize(empty.cpu(), 4, 64)),
                   (T.hadamard_quantize(empty, 8, 128), R.hadamard_quantize(empty.cpu(), 8, 128)),
                   (T.quantize_weight_diff(empty, empty, 8, 32), R.quantize_weight_diff(
                       empty.cpu(), empty.cpu(), 8, 32))]:
        assert_same_quantized(q, ref)
    q = T.quantize(empty, 4, 64)
    assert T.dequantize(q).shape == (0,)
    assert T.dequantize_add_(empty.clone(), q).shape == (0,)
    assert T.dequantize_sum(q, 2).shape == (0,)
    assert T.dequantize_sum_requantize(q, 2, 4, 64).numel == 0


# --- stochastic rounding -------------------------------------------------------------

def _assert_floor_or_ceil(q: QuantizedTensor, values: torch.Tensor, reference_scales):
    """Each code is floor(v) or floor(v) + 1 (clamped), v = value / scale: error < scale."""
    assert_same_values(q.scales, reference_scales)  # the scale does not depend on rounding
    levels = qmax(q.bits)
    padded = torch.zeros(q.padded_numel)
    padded[: values.numel()] = values
    scales = q.scales.cpu()
    # Usable: a finite scale > 0 with a finite inverse (else codes 0, reference.py).
    usable = torch.isfinite(scales) & (scales > 0) & torch.isfinite(1.0 / scales)
    inv = torch.where(usable, 1.0 / scales, torch.zeros_like(scales))
    v = padded.view(-1, q.group_size) * inv.unsqueeze(1)
    low = v.floor().clamp(-levels - 1, levels)
    high = (v.floor() + 1).clamp(-levels - 1, levels)
    codes = codes_of(q).view(-1, q.group_size)
    ok = (codes == low) | (codes == high)
    assert bool(ok[usable].all()), f"{int((~ok[usable]).sum())} codes are neither floor nor ceil"
    assert bool((codes[~usable] == 0).all())
    assert 0 < int((codes[usable] == high[usable]).sum()) < int(usable.sum()) * q.group_size


def test_stochastic_codes_are_floor_or_ceil_for_every_op():
    gen = torch.Generator(DEVICE).manual_seed(5)
    x = awkward_input(9 * 128 - 32, 128, 4, seed=5)
    q = T.quantize(x, 4, 128, "stochastic", gen)
    _assert_floor_or_ceil(q, x.cpu(), R.quantize(x.cpu(), 4, 128, "nearest").scales)
    q = T.hadamard_quantize(x, 8, 128, 32, "stochastic", gen, scale=0.5)
    transformed = hadamard_transform(x.cpu() * 0.5, 32)
    _assert_floor_or_ceil(q, transformed, R.hadamard_quantize(x.cpu(), 8, 128, 32, "nearest",
                                                              scale=0.5).scales)
    received = received_buffer(4, 256, 8, 128, specials=False)  # NaN would spread to every sum
    q = T.dequantize_sum_requantize(received, 4, 2, 64, "stochastic", gen)
    total = _sequential_chunk_sum(received, 4)
    _assert_floor_or_ceil(q, total, R.quantize(total, 2, 64, "nearest").scales)


def _mean_abs_bias(rounding: str, draws: int, repeats: int):
    """Largest |mean(dequantized) - x| over 63 values, each seen draws*repeats times.

    Every group is [63 values with fractional parts in [0.1, 0.9], 7.0], so its
    4-bit scale is exactly 1 and each value is rounded independently in every
    group (Philox is keyed by the element index) and every draw.
    """
    frac = torch.linspace(0.1, 0.9, 63)
    whole = torch.arange(63) % 13 - 6.0
    pattern = torch.cat([whole + frac, torch.tensor([7.0])])
    x = pattern.repeat(repeats).to(DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(2024)
    total = torch.zeros(repeats, 64)
    for _ in range(draws):
        q = T.quantize(x, 4, 64, rounding, gen)
        assert bool((q.scales.cpu() == 1.0).all())
        total += codes_of(q).view(repeats, 64)
    mean = total.sum(0) / (draws * repeats)
    return float((mean[:63] - pattern[:63]).abs().max())


def test_stochastic_rounding_is_unbiased():
    draws, repeats, values, delta = 4, 512, 63, 1e-6
    samples = draws * repeats
    # Hoeffding for samples in [floor v, floor v + 1] (width = scale = 1), union bound
    # over the 63 values: P(any |mean - v| > bound) <= delta.
    bound = math.sqrt(math.log(2 * values / delta) / (2 * samples))
    assert bound < 0.07
    assert _mean_abs_bias("stochastic", draws, repeats) <= bound
    # The check has power: rounding to nearest is off by >= 0.1 on some value.
    assert _mean_abs_bias("nearest", 1, 8) >= 0.1 > bound


def test_stochastic_rounding_is_reproducible_from_the_generator():
    x = awkward_input(1000, 64, 4, seed=9)

    def draw(seed, calls=1):
        gen = torch.Generator(DEVICE).manual_seed(seed)
        return [T.quantize(x, 4, 64, "stochastic", gen).codes.cpu() for _ in range(calls)]

    first, second = draw(1, calls=2)
    assert torch.equal(first, draw(1)[0])  # same generator state: same codes
    assert not torch.equal(first, second)  # the generator advanced: a new draw
    assert not torch.equal(first, draw(2)[0])
    cpu_gen = torch.Generator().manual_seed(1)  # a CPU generator serves CUDA data too
    T.quantize(x, 4, 64, "stochastic", cpu_gen)
    torch.manual_seed(0)
    T.quantize(x, 4, 64, "stochastic")  # generator=None: the default generator


def test_stochastic_codes_do_not_depend_on_the_tiling():
    # Noise is keyed by (seed, element index): programs of 1 or many groups, groups
    # read in one pass or in 256-column slices, all give the same codes.
    for bits, group, numel in [(4, 2048, 3 * 2048 - 5), (8, 12, 100), (2, 4, 37), (8, 1, 9)]:
        x = awkward_input(numel, group, bits, seed=group, specials=False)
        results = []
        for tile, max_group in [(1 << 16, 1 << 16), (256, 256), (1024, 512)]:
            with launch_plan.tuning(tile_elements=tile, max_group_block=max_group):
                gen = torch.Generator(DEVICE).manual_seed(3)
                results.append(T.quantize(x, bits, group, "stochastic", gen).codes.cpu())
        assert all(torch.equal(results[0], r) for r in results[1:]), (bits, group)


@pytest.mark.parametrize("module", ["triton", "reference"])
def test_a_prepared_call_repeats_the_call_with_fresh_draws(module):
    """``op.prepare`` binds, checks and works out a call once; each ``run(generator)`` then
    writes what the plain call writes with that generator (the collectives' every-step
    path), for the three ops a reduce-scatter chunk makes and the two of a weight gather."""
    ops = T if module == "triton" else R
    device = DEVICE if module == "triton" else "cpu"
    rows = awkward_input(4 * 96, 32, 8, seed=4, specials=False).to(device).view(4, 96)
    order = torch.tensor([2, 0, 3, 1], device=device)
    main = awkward_input(300, 64, 4, seed=5, specials=False).to(device)
    model = awkward_input(300, 64, 4, seed=6, specials=False).to(device).to(torch.bfloat16)

    def calls(out, summed, received, base, prepared):
        first = dict(rows=rows, order=order, start=16, valid=80, padded=128, bits=8,
                     group_size=32, hadamard_block=32, rounding="stochastic", scale=0.25, out=out)
        second = dict(q=received, num_chunks=4, bits=4, group_size=64, rounding="stochastic",
                      out=summed)
        diff = dict(main_shard=main, model_shard=model, bits=4, group_size=64,
                    rounding="stochastic")
        if prepared:
            runs = [ops.hadamard_quantize_rows.prepare(**first),
                    ops.dequantize_sum_requantize.prepare(**second),
                    ops.quantize_weight_diff.prepare(**diff)]
            return lambda gen: [run(gen) for run in runs] + [
                ops.dequantize_sum.prepare(summed, 2, 32, None)(),
                ops.dequantize_add_.prepare(base, summed)()]
        return lambda gen: [ops.hadamard_quantize_rows(**first, generator=gen),
                            ops.dequantize_sum_requantize(**second, generator=gen),
                            ops.quantize_weight_diff(**diff, generator=gen),
                            ops.dequantize_sum(summed, 2, 32, None),
                            ops.dequantize_add_(base, summed)]

    results = {}
    for prepared in (False, True):
        out = ops.quantize(torch.zeros(512, device=device), 8, 32, "nearest")
        received = ops.quantize(awkward_input(512, 32, 8, seed=7, specials=False).to(device),
                                8, 32, "nearest")
        summed = ops.quantize(torch.zeros(128, device=device), 4, 64, "nearest")
        base = torch.zeros(128, device=device)
        run = calls(out, summed, received, base, prepared)
        gen = torch.Generator(device).manual_seed(11)
        results[prepared] = [[t.codes.cpu().clone() if hasattr(t, "codes") else t.cpu().clone()
                              for t in run(gen)] for _ in range(2)]  # two steps: two draws
    for step_plain, step_prepared in zip(results[False], results[True]):
        for a, b in zip(step_plain, step_prepared):
            assert torch.equal(a, b)
    assert not torch.equal(results[True][0][0], results[True][1][0])  # the second step drew anew


def test_philox2x32_matches_the_published_known_answers():
    # Random123's kat_vectors for philox2x32 with 10 rounds: (ctr0, ctr1, key) -> out.
    vectors = [((0x00000000, 0x00000000, 0x00000000), (0xFF1DAE59, 0x6CD10DF2)),
               ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0x2C3F628B, 0xAB4FD7AD)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E), (0xDD7CE038, 0xF62A4C12))]
    inputs = torch.tensor([v for (ctr, _) in vectors for v in ctr], dtype=torch.int64)
    inputs, out = inputs.to(DEVICE), torch.zeros(6, dtype=torch.int64, device=DEVICE)
    _philox_kat_kernel[(1,)](inputs, out)
    assert out.cpu().tolist() == [v for (_, answer) in vectors for v in answer]


# --- contract and errors ---------------------------------------------------------------

def test_api_matches_the_reference():
    for name in T.__all__:
        assert inspect.signature(getattr(T, name)) == inspect.signature(getattr(R, name)), name


def test_bad_arguments_raise_value_errors():
    x = torch.randn(256, device=DEVICE)
    q = T.quantize(x, 4, 64, "nearest")
    with pytest.raises(ValueError, match="bits"):
        T.quantize(x, 3, 64)
    with pytest.raises(ValueError, match="rounding"):
        T.quantize(x, 4, 64, "up")
    with pytest.raises(ValueError, match="multiple of the Hadamard block"):
        T.hadamard_quantize(x[:250], 8, 128, 32)
    with pytest.raises(ValueError, match="contiguous"):
        T.dequantize_add_(torch.zeros(512, device=DEVICE)[::2], q)
    with pytest.raises(ValueError, match="do not hold"):
        T.dequantize(QuantizedTensor(q.codes[:-1], q.scales, 4, 64, 256))
    with pytest.raises(ValueError, match="equal chunks"):
        T.dequantize_sum(q, 3)
    with pytest.raises(ValueError, match="group boundary"):
        T.dequantize_sum_requantize(q, 8)
    with pytest.raises(ValueError, match="generator"):
        T.quantize(x, 4, 64, "stochastic", generator=1)


@pytest.mark.skipif(DEVICE != "cpu", reason="the message for CPU tensors with compiled kernels")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(T, "INTERPRETED", False)
    with pytest.raises(ValueError, match="CUDA"):
        T.quantize(torch.randn(64), 4, 64)


@pytest.mark.skipif(DEVICE != "cuda", reason="dispatch to Triton happens for CUDA tensors")
def test_dispatcher_sends_cuda_tensors_to_triton():
    from megatron_sdp4bit import quant
    assert quant.backend_for(torch.empty(1, device="cuda")).__name__ == T.__name__


# --- what a plain (non-interpreter) pytest process runs ---------------------------------

@pytest.mark.slow
def test_kernels_compile_for_the_gpu_without_fp_contraction_or_ftz(tmp_path):
    # The interpreter runs Python, so compile every variant for sm_90 as well:
    # catches code only the compiler rejects, and FMA / FTZ in the PTX.
    ptx_dir = str(tmp_path / "ptx")
    result = subprocess.run(
        [sys.executable, "-m", "megatron_sdp4bit.quant.triton_kernels.compile_check", "--arch", "90",
         "--ptx-dir", ptx_dir],
        cwd=REPO_ROOT, env=_python_env(TRITON_INTERPRET="0"), capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from megatron_sdp4bit.quant.triton_kernels.compile_check import variant_file_name, variants
    names = sorted(variant_file_name(name) for name, _ in variants("all"))
    assert sorted(os.listdir(ptx_dir)) == names and len(set(names)) == len(names)
    text = open(os.path.join(ptx_dir, names[0])).read()
    assert ".entry" in text and ".loc" not in text and ".debug" not in text


def test_kernel_tests_pass_in_the_triton_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + [os.path.join(os.path.dirname(os.path.abspath(__file__)), f) for f in KERNEL_TEST_FILES],
        cwd=REPO_ROOT, env=_python_env(TRITON_INTERPRET="1"), capture_output=True, text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print("interpreter run:", summary[0])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


# Keep only the tests this process can run (see the module docstring).
_PARENT_TESTS = ("test_kernels_compile_for_the_gpu_without_fp_contraction_or_ftz",
                 "test_kernel_tests_pass_in_the_triton_interpreter")
for _name in [n for n in list(globals()) if n.startswith("test_")]:
    if DEVICE == "cuda":
        drop = _name == "test_kernel_tests_pass_in_the_triton_interpreter"
    else:  # CPU: the interpreter process runs the kernel tests, a plain one the rest
        drop = (_name in _PARENT_TESTS) == KERNELS_HERE
    if drop:
        del globals()[_name]
