"""The Triton kernels on the collectives' API: wire (k-chunk) tensors, out=, the rows op.

Run like test_triton.py's kernel tests (which re-runs this file in Triton's
interpreter; ``SDP4BIT_TRITON_TEST_DEVICE=cuda`` on a GPU). Against the torch
reference (on CPU copies) and against the same data laid out flat:

- consumers read a k-chunk tensor whose rows are segments of one wire buffer
  bit for bit like the flat layout (aligned chunks) and like the reference
  (unaligned chunks, each padded on its own);
- producers write straight into ``out`` (flat or a wire view) what they return
  without it; nearest rounding bit-identical to the reference; stochastic
  rounding gives the same codes in a wire view as flat (noise keyed by the
  element index);
- hadamard_quantize_rows equals hadamard_quantize of the staged rows: bit for
  bit under nearest rounding, the same codes under stochastic rounding with the
  same generator state.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_sdp4bit.quant import reference as R
from megatron_sdp4bit.quant.types import QuantizedTensor, qmax
from megatron_sdp4bit.quant.wire import empty_wire
from triton_cases import (
    DEVICE,
    KERNELS_HERE,
    assert_same_values,
    awkward_input,
    codes_of,
    few_large_programs,  # noqa: F401  (an autouse fixture)
)

if not KERNELS_HERE:
    pytest.skip("kernel tests: run by test_triton.py in Triton's interpreter (or on CUDA)",
                allow_module_level=True)

from triton_cases import T, launch_plan  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")


def gen(seed):
    return torch.Generator(DEVICE).manual_seed(seed)


def device_wire(q: QuantizedTensor) -> QuantizedTensor:
    """A copy of wire tensor ``q`` in a new wire buffer on DEVICE."""
    buffer, out = empty_wire(q.num_chunks, q.chunk_numel, q.bits, q.group_size, DEVICE, q.dtype)
    out.codes.copy_(q.codes)
    out.scales.copy_(q.scales)
    return out


def reference_wire(x: torch.Tensor, k: int, bits: int, group: int) -> QuantizedTensor:
    _, q = empty_wire(k, x.numel() // k, bits, group, "cpu")
    return R.quantize(x.cpu(), bits, group, "nearest", out=q)


def assert_same_bytes(actual: QuantizedTensor, expected: QuantizedTensor):
    """Same format, codes bytes and scales, whatever the two layouts (flat, wire)."""
    assert (actual.bits, actual.group_size, actual.numel) == (
        expected.bits, expected.group_size, expected.numel)
    assert actual.codes.device.type == DEVICE
    as_bytes = [q.codes.cpu().reshape(-1).view(torch.uint8) for q in (actual, expected)]
    assert torch.equal(*as_bytes), "codes differ"
    assert_same_values(actual.scales.cpu().reshape(-1), expected.scales.cpu().reshape(-1))


# --- consumers ------------------------------------------------------------------------

@pytest.mark.parametrize("bits,group", [(4, 128), (8, 64), (2, 16)])
def test_k_chunk_consumers_read_like_the_flat_layout(bits, group):
    k, n = 4, 3 * group
    x = awkward_input(k * n, group, bits, seed=bits)
    flat = R.quantize(x.cpu(), bits, group, "nearest")
    wire = device_wire(reference_wire(x, k, bits, group))
    flat_dev = QuantizedTensor(flat.codes.to(DEVICE), flat.scales.to(DEVICE), bits, group, k * n)
    assert_same_values(T.dequantize(wire), R.dequantize(flat))
    for block in (None, 16):
        assert_same_values(T.dequantize_sum(wire, k, block), R.dequantize_sum(flat, k, block))
        assert_same_values(T.dequantize_sum(wire, k, block), T.dequantize_sum(flat_dev, k, block))
    base = awkward_input(k * n, group, bits, torch.bfloat16, seed=9, specials=False)
    assert_same_values(T.dequantize_add_(base.clone(), wire), R.dequantize_add_(base.cpu(), flat))
    requantized = T.dequantize_sum_requantize(wire, k, 4, 2 * group, "nearest")
    assert_same_bytes(requantized, R.dequantize_sum_requantize(flat, k, 4, 2 * group, "nearest"))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_k_chunk_dequantize_add_of_unaligned_chunks_in_one_launch(out_dtype):
    # The weight all-gather: P shards of n elements, each with its own padded last group,
    # added into base[c] (flat, or the [P, n] slice of every shard: a row stride).
    k, n, group = 3, 2 * 2048 + 77, 2048
    x = awkward_input(k * n, 1024, 4, seed=3)
    ref = reference_wire(x, k, 4, group)
    wire = device_wire(ref)
    assert_same_values(T.dequantize(wire), R.dequantize(ref))
    base = awkward_input(k * n, 1024, 4, out_dtype, seed=4, specials=False)
    assert_same_values(T.dequantize_add_(base.clone(), wire), R.dequantize_add_(base.cpu(), ref))
    shards = awkward_input(k * (n + 45), 1024, 4, out_dtype, seed=5, specials=False).view(k, n + 45)
    expected = R.dequantize_add_(shards.cpu().clone()[:, 13:13 + n], ref)
    untouched = shards.cpu().clone()
    T.dequantize_add_(shards[:, 13:13 + n], wire)
    assert_same_values(shards[:, 13:13 + n], expected)
    assert_same_values(shards[:, :13], untouched[:, :13])
    assert_same_values(shards[:, 13 + n:], untouched[:, 13 + n:])


# --- producers into out= ---------------------------------------------------------------

@pytest.mark.parametrize("k,n", [(1, 3 * 2048 + 5), (3, 2048 + 100), (2, 4096)])
def test_quantize_and_weight_diff_write_into_wire_views(k, n):
    main = awkward_input(k * n, 2048, 4, seed=k)
    model = (main * 0.999).to(torch.bfloat16)
    for op, args, cpu_args in [(T.quantize, (main,), (main.cpu(),)),
                               (T.quantize_weight_diff, (main, model), (main.cpu(), model.cpu()))]:
        _, out = empty_wire(k, n, 4, 2048, DEVICE)
        assert op(*args, 4, 2048, "nearest", out=out) is out
        _, expected = empty_wire(k, n, 4, 2048, "cpu")
        getattr(R, op.__name__)(*cpu_args, 4, 2048, "nearest", out=expected)
        assert_same_bytes(out, expected)


def test_hadamard_quantize_and_requantize_write_into_wire_views():
    x = awkward_input(4 * 256, 128, 8, torch.bfloat16, seed=6)
    _, out = empty_wire(4, 256, 8, 128, DEVICE)
    T.hadamard_quantize(x, 8, 128, 32, "nearest", scale=0.25, out=out)
    assert_same_bytes(out, R.hadamard_quantize(x.cpu(), 8, 128, 32, "nearest", scale=0.25))
    # The step between the hops: L = 4 received chunks in, N = 2 send chunks out.
    received = device_wire(reference_wire(awkward_input(4 * 512, 128, 8, seed=7), 4, 8, 128))
    _, sent = empty_wire(2, 256, 4, 128, DEVICE)
    T.dequantize_sum_requantize(received, 4, 4, 128, "nearest", out=sent)
    on_cpu = QuantizedTensor(received.codes.cpu(), received.scales.cpu(), 8, 128, 4 * 512)
    assert_same_bytes(sent, R.dequantize_sum_requantize(on_cpu, 4, 4, 128, "nearest"))


def test_stochastic_codes_in_a_wire_view_equal_the_flat_ones():
    # Aligned chunks: element i of chunk c is element c*n + i of the flat tensor, and
    # the noise is keyed by that index, so the same generator state gives the same codes.
    x = awkward_input(4 * 512, 128, 8, seed=8, specials=False)
    _, out = empty_wire(4, 512, 4, 128, DEVICE)
    T.quantize(x, 4, 128, "stochastic", gen(3), out=out)
    assert_same_bytes(out, T.quantize(x, 4, 128, "stochastic", gen(3)))
    _, out = empty_wire(4, 512, 8, 128, DEVICE)
    T.hadamard_quantize(x, 8, 128, 32, "stochastic", gen(4), 0.5, out=out)
    assert_same_bytes(out, T.hadamard_quantize(x, 8, 128, 32, "stochastic", gen(4), 0.5))


@pytest.mark.parametrize("make_out,message", [
    (lambda: empty_wire(2, 100, 4, 64, DEVICE)[1], "holds 200 elements, this call makes 1000"),
    (lambda: empty_wire(1, 1000, 8, 64, DEVICE)[1], "8-bit codes"),
    (lambda: empty_wire(1, 1000, 4, 64, "meta")[1], "out is on meta"),
    (lambda: QuantizedTensor(torch.zeros(512, dtype=torch.int16, device=DEVICE),
                             torch.zeros(16, device=DEVICE), 4, 64, 1000), "uint8"),
])
def test_a_wrong_out_is_one_clear_value_error(make_out, message):
    with pytest.raises(ValueError, match=message):
        T.quantize(torch.zeros(1000, device=DEVICE), 4, 64, "nearest", out=make_out())


# --- hadamard_quantize_rows ---------------------------------------------------------------

ROW_CASES = [  # (start, valid, padded): full chunks, an offset chunk, a last chunk with padding
    (0, 256, 256), (256, 128, 128), (384, 100, 128), (0, 0, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", [None, (2, 0, 3, 1)])
@pytest.mark.parametrize("start,valid,padded", ROW_CASES)
def test_rows_op_nearest_is_bit_identical_to_quantizing_the_staged_rows(start, valid, padded,
                                                                          order, dtype):
    rows = awkward_input(4 * 520, 128, 8, dtype, seed=start + valid).view(4, 520)
    index = None if order is None else torch.tensor(order, device=DEVICE)
    cpu_index = None if order is None else index.cpu()
    expected = R.hadamard_quantize_rows(rows.cpu(), cpu_index, start, valid, padded, 8, 128, 32,
                                        "nearest", scale=0.25)
    assert torch.equal(expected.codes, R.hadamard_quantize(
        R.stage_rows(rows.cpu(), cpu_index, start, valid, padded), 8, 128, 32, "nearest",
        scale=0.25).codes)
    flat = T.hadamard_quantize_rows(rows, index, start, valid, padded, 8, 128, 32, "nearest",
                                    scale=0.25)
    assert_same_bytes(flat, expected)
    _, out = empty_wire(2, 2 * padded, 8, 128, DEVICE)  # the first hop: 2 peers, 2 rows each
    T.hadamard_quantize_rows(rows, index, start, valid, padded, 8, 128, 32, "nearest",
                             scale=0.25, out=out)
    assert_same_bytes(out, expected)
    four = T.hadamard_quantize_rows(rows, index, start, valid, padded, 4, 64, None, "nearest")
    assert_same_bytes(four, R.hadamard_quantize_rows(rows.cpu(), cpu_index, start, valid, padded,
                                                     4, 64, None, "nearest"))


@pytest.mark.parametrize("start,valid,padded", [(128, 256, 256), (384, 100, 128)])
def test_rows_op_stochastic_gives_the_codes_of_the_flat_op_on_the_staged_rows(start, valid, padded):
    rows = awkward_input(4 * 520, 128, 8, torch.bfloat16, seed=11, specials=False).view(4, 520)
    index = torch.tensor([3, 1, 0, 2], device=DEVICE)
    staged = R.stage_rows(rows, index, start, valid, padded)
    _, out = empty_wire(4, padded, 8, 128, DEVICE)
    T.hadamard_quantize_rows(rows, index, start, valid, padded, 8, 128, 32, "stochastic",
                             gen(5), 0.25, out=out)
    flat = T.hadamard_quantize(staged, 8, 128, 32, "stochastic", gen(5), 0.25)
    assert_same_bytes(out, flat)
    # And each code is floor(v) or floor(v) + 1 of the staged, transformed value.
    from megatron_sdp4bit.quant.hadamard import hadamard_transform
    v = hadamard_transform(staged.cpu().float() * 0.25, 32).view(-1, 128)
    scales = R.hadamard_quantize(staged.cpu(), 8, 128, 32, "nearest", scale=0.25).scales
    assert_same_values(out.scales.cpu().reshape(-1), scales)
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    low = (v * inv[:, None]).floor().clamp(-qmax(8) - 1, qmax(8))
    codes = codes_of(out).view(-1, 128)
    assert bool(((codes == low) | (codes == (low + 1).clamp(max=qmax(8)))).all())


def test_rows_op_refuses_bad_arguments_like_the_reference():
    rows = torch.zeros(4, 512, device=DEVICE)
    for kwargs, message in [(dict(valid=300), "valid <= padded"),
                            (dict(order=torch.tensor([0, 1, 2], device=DEVICE)), "order must be"),
                            (dict(padded=200, valid=100), "multiple of group_size")]:
        call = dict(order=None, start=0, valid=256, padded=256)
        call.update(kwargs)
        with pytest.raises(ValueError, match=message):
            T.hadamard_quantize_rows(rows, call["order"], call["start"], call["valid"],
                                     call["padded"], 8, 128, 32, "nearest")


# --- the noise contract and the two paths ------------------------------------------------

def _philox2x32(counter: np.ndarray, key: int):
    """Philox-2x32-10 in numpy (uint64 arithmetic), the words for each 64-bit counter."""
    c0, c1 = counter & 0xFFFFFFFF, counter >> 32
    k = np.uint64(key)
    for _ in range(10):
        product = c0 * np.uint64(0xD256D193)
        c0, c1 = ((product >> np.uint64(32)) ^ k ^ c1) & np.uint64(0xFFFFFFFF), product & np.uint64(0xFFFFFFFF)
        k = (k + np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    return c0, c1


def test_the_numpy_philox_model_matches_the_published_known_answers():
    vectors = [((0x00000000, 0x00000000, 0x00000000), (0xFF1DAE59, 0x6CD10DF2)),
               ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0x2C3F628B, 0xAB4FD7AD)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E), (0xDD7CE038, 0xF62A4C12))]
    for (lo, hi, key), answer in vectors:
        words = _philox2x32(np.array([lo | hi << 32], dtype=np.uint64), key)
        assert (int(words[0][0]), int(words[1][0])) == answer


def _expected_stochastic_codes(v: np.ndarray, group: int, seed: int) -> np.ndarray:
    """The contract: code = floor((rne(256 v) + k) / 256) for the exact v = x * inv (fp64),
    k = byte i % 4 of word i // 4 of Philox(counter = flat padded index of the element's
    run of 8, key = seed)."""
    index = np.arange(v.size, dtype=np.uint64)
    col = index % np.uint64(group)
    run_start = index - col + col // np.uint64(8) * np.uint64(8)
    w0, w1 = _philox2x32(run_start, seed)
    within = (col % np.uint64(8)).astype(np.int64)
    word = np.where(within < 4, w0, w1)
    k = (word >> (np.uint64(8) * (within % 4).astype(np.uint64))) & np.uint64(0xFF)
    r = np.round(v.astype(np.float64) * 256)  # numpy rounds half to even, exact here
    return np.floor((r + k.astype(np.float64)) / 256)


@pytest.mark.parametrize("strips", [True, False])
@pytest.mark.parametrize("bits,group,dtype", [(4, 2048, torch.float32), (8, 128, torch.bfloat16),
                                              (2, 64, torch.float32), (4, 96, torch.float32)])
def test_stochastic_codes_are_the_defined_function_of_seed_and_element_index(bits, group, dtype,
                                                                              strips):
    groups = max(3, 4096 // group + 1)
    x = awkward_input(groups * group, group, bits, dtype, seed=group, specials=False).cpu()
    # Groups where rounding x * inv to fp32 first would change R: the absmax makes the
    # scale 1536 (inv = fp32(1/1536), just above 1/1536), and 3 * inv lies just above
    # 1/512, a tie of the 1/256 grid once rounded to fp32. Such an element's code
    # differs only for noise byte 255: > 4000 of them make a difference certain.
    tie = dtype == torch.float32  # (bf16 cannot hold 127 * 1536)
    if tie:
        x[group:] = 3.0
        x[group::group] = qmax(bits) * 1536.0
    x = x.to(DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(17)
    seed = int(torch.randint(2**31 - 1, (1,), generator=gen.clone_state(), device=gen.device))
    with launch_plan.tuning(strips=strips):
        q = T.quantize(x, bits, group, "stochastic", gen)
    scales = q.scales.cpu()
    assert bool((scales > 0).all()) and (not tie or float(scales[1]) == 1536.0)
    inv = (1 / scales).double()  # fp32 reciprocals, as the kernels compute them
    v = (x.cpu().double().view(-1, group) * inv[:, None]).view(-1)  # exact products
    expected = _expected_stochastic_codes(v.numpy(), group, seed)
    assert np.array_equal(codes_of(q).numpy(), expected)
    if tie:  # the test tells the exact product from the rounded one
        rounded_first = _expected_stochastic_codes(v.float().double().numpy(), group, seed)
        assert not np.array_equal(expected, rounded_first)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("case", ["quantize bf16", "hadamard", "rows", "requantize", "tail"])
def test_the_strip_path_and_the_generic_path_give_the_same_bits(case, rounding):
    def run():
        gen = torch.Generator(DEVICE).manual_seed(3)
        if case == "quantize bf16":
            return T.quantize(awkward_input(4 * 256, 256, 4, torch.bfloat16, seed=1), 4, 256,
                              rounding, gen)
        if case == "hadamard":
            return T.hadamard_quantize(awkward_input(4 * 128, 128, 8, seed=2), 8, 128, 32,
                                       rounding, gen, 0.25)
        if case == "rows":
            rows = awkward_input(4 * 520, 128, 8, torch.bfloat16, seed=3).view(4, 520)
            return T.hadamard_quantize_rows(rows, torch.tensor([1, 3, 0, 2], device=DEVICE), 256,
                                            200, 256, 8, 128, 32, rounding, gen, 0.5)
        if case == "requantize":
            received = device_wire(reference_wire(awkward_input(4 * 512, 128, 8, seed=4,
                                                                specials=False), 4, 8, 128))
            return T.dequantize_sum_requantize(received, 4, 4, 128, rounding, gen)
        return T.quantize_weight_diff(awkward_input(3 * 64 + 40, 64, 4, seed=5),
                                      awkward_input(3 * 64 + 40, 64, 4, torch.bfloat16, seed=6),
                                      4, 64, rounding, gen)

    with launch_plan.tuning(strips=False):
        generic = run()
    assert_same_bytes(run(), generic)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", ["dequantize fp32", "dequantize fp16", "dequantize bf16 tail",
                                  "add bf16 rows", "add fp32 tail", "sum + H", "sum bf16 wire"])
def test_the_dequantize_strip_path_and_the_generic_path_give_the_same_bits(case, bits):
    k, n = 3, 2 * 256 + (45 if "tail" in case or "rows" in case else 0)
    x = awkward_input(k * n, 128, bits, seed=bits, specials=False)
    wire = device_wire(reference_wire(x, k, bits, 128))
    base = awkward_input(k * (n + 7), 128, bits, seed=9, specials=False)

    def run():
        if case.startswith("dequantize"):
            dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[case.split()[1]]
            return T.dequantize(wire, dtype)
        if case == "add bf16 rows":  # [k, n] rows of a wider buffer: an odd row stride
            rows = base.to(torch.bfloat16).view(k, n + 7)
            T.dequantize_add_(rows[:, 3:3 + n], wire)
            return rows
        if case == "add fp32 tail":
            return T.dequantize_add_(base[: k * n].clone(), wire)
        summed = device_wire(reference_wire(x[: k * 512], k, bits, 128))
        if case == "sum + H":
            return T.dequantize_sum(summed, k, 32)
        out = torch.zeros(512, dtype=torch.bfloat16, device=DEVICE)
        return T.dequantize_sum(summed, k, 32, out=out)

    with launch_plan.tuning(strips=False):
        generic = run()
    assert_same_values(run(), generic)
