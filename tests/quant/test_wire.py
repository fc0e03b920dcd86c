"""The wire layout and the k-chunk form, on the torch reference (the specification).

- wire.py: segment sizes, aligned parts, zero-copy views of one uint8 buffer;
- every consumer reads a k-chunk tensor (rows of a wire buffer) exactly as the
  same chunks laid out flat; every producer writes into ``out=`` exactly what it
  returns without it, chunk c from input elements [c*n, (c+1)*n);
- hadamard_quantize_rows is its definition: stage the rows, then hadamard_quantize.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sdp4bit import quant
from megatron_sdp4bit.quant import reference as R
from megatron_sdp4bit.quant.types import QuantizedTensor
from megatron_sdp4bit.quant.wire import SEGMENT_ALIGN, empty_wire, segment_layout, wire_view


def randn(n, seed, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def assert_same(a: QuantizedTensor, b: QuantizedTensor):
    assert (a.bits, a.group_size, a.numel) == (b.bits, b.group_size, b.numel)
    assert torch.equal(a.codes.reshape(-1).view(torch.uint8), b.codes.reshape(-1).view(torch.uint8))
    assert torch.equal(a.scales.reshape(-1), b.scales.reshape(-1))


# --- wire.py -------------------------------------------------------------------------

@pytest.mark.parametrize("numel,bits,group", [(1000, 4, 128), (2048, 8, 2048), (3, 2, 8), (0, 4, 64)])
def test_segment_layout_is_codes_then_aligned_scales(numel, bits, group):
    layout = segment_layout(numel, bits, group)
    assert layout.codes_nbytes == QuantizedTensor.codes_nbytes(numel, bits, group)
    assert layout.groups == -(-numel // group)
    assert layout.scales_offset % SEGMENT_ALIGN == 0 and layout.nbytes % SEGMENT_ALIGN == 0
    assert layout.codes_nbytes <= layout.scales_offset < layout.codes_nbytes + SEGMENT_ALIGN or numel == 0
    assert layout.scales_offset + 4 * layout.groups <= layout.nbytes
    assert layout.nbytes - layout.scales_offset - 4 * layout.groups < SEGMENT_ALIGN


def test_wire_view_rows_are_segments_of_one_buffer():
    buffer, q = empty_wire(3, 1000, 4, 128, "cpu")
    seg = segment_layout(1000, 4, 128)
    assert buffer.numel() == 3 * seg.nbytes and q.num_chunks == 3 and q.chunk_numel == 1000
    assert q.codes.shape == (3, 512) and q.scales.shape == (3, 8) and q.scales.dtype == torch.float32
    assert q.codes.stride(0) == seg.nbytes and q.scales.stride(0) * 4 == seg.nbytes
    base = buffer.data_ptr()
    for c in range(3):
        assert q.codes[c].data_ptr() == base + c * seg.nbytes
        assert q.scales[c].data_ptr() == base + c * seg.nbytes + seg.scales_offset
    q.scales[1].fill_(2.5)  # a view: writes land in the buffer
    assert torch.equal(buffer[seg.nbytes + seg.scales_offset:][:4].view(torch.float32),
                       torch.tensor([2.5]))
    assert wire_view(buffer, 3, 1000, 4, 128).codes.data_ptr() == base
    assert empty_wire(2, 256, 8, 128, "cpu")[1].codes.dtype == torch.int8


@pytest.mark.parametrize("call,message", [
    (lambda b: wire_view(b[:-1], 3, 1000, 4, 128), "at least"),
    (lambda b: wire_view(b.view(torch.int8), 3, 1000, 4, 128), "uint8"),
    (lambda b: wire_view(b[1:], 1, 1000, 4, 128), "4-byte boundary"),
    (lambda b: wire_view(b, 0, 1000, 4, 128), "num_chunks"),
    (lambda b: wire_view(b, 1, 1000, 3, 128), "bits"),
])
def test_wire_view_refuses_bad_buffers(call, message):
    buffer, _ = empty_wire(3, 1000, 4, 128, "cpu")
    with pytest.raises(ValueError, match=message):
        call(buffer)


# --- consumers: the k-chunk form reads like the flat one -----------------------------

@pytest.mark.parametrize("n,bits,group", [(1000, 4, 128), (4096, 8, 2048), (96, 2, 8)])
def test_dequantize_and_add_of_k_chunks_put_chunk_c_at_c_times_n(n, bits, group):
    k = 3
    x = randn(k * n, 1)
    _, q = empty_wire(k, n, bits, group, "cpu")
    R.quantize(x, bits, group, "nearest", out=q)
    expected = torch.cat([R.dequantize(R.quantize(x[c * n:(c + 1) * n], bits, group, "nearest"))
                          for c in range(k)])
    assert torch.equal(R.dequantize(q), expected)
    assert torch.equal(quant.dequantize(q, torch.bfloat16), expected.to(torch.bfloat16))
    base = randn(k * n, 2, torch.bfloat16)
    flat_sum = (base.float() + expected).to(torch.bfloat16)
    assert torch.equal(R.dequantize_add_(base.clone(), q), flat_sum)
    # A [k, n] base with a row stride: e.g. slice [start, start + n) of every shard.
    shards = randn(k * (n + 40), 3, torch.bfloat16).view(k, n + 40)
    before = shards.clone()
    R.dequantize_add_(shards[:, 7:7 + n], q)
    assert torch.equal(shards[:, 7:7 + n].reshape(-1), (before[:, 7:7 + n].reshape(-1).float()
                                                        + expected).to(torch.bfloat16))
    assert torch.equal(shards[:, :7], before[:, :7]) and torch.equal(shards[:, 7 + n:], before[:, 7 + n:])


@pytest.mark.parametrize("block", [None, 32])
def test_chunk_sums_of_k_chunks_equal_the_flat_layout(block):
    k, n = 4, 4 * 128
    x = randn(k * n, 4)
    flat = R.quantize(x, 8, 128, "nearest")
    _, q = empty_wire(k, n, 8, 128, "cpu")
    R.quantize(x, 8, 128, "nearest", out=q)
    assert_same(q, flat)  # aligned chunks: the same bytes, only laid out apart
    assert torch.equal(R.dequantize_sum(q, k, block), R.dequantize_sum(flat, k, block))
    _, out = empty_wire(2, n // 2, 4, 64, "cpu")
    R.dequantize_sum_requantize(q, k, 4, 64, "stochastic", gen(5), out=out)
    assert_same(out, R.dequantize_sum_requantize(flat, k, 4, 64, "stochastic", gen(5)))
    with pytest.raises(ValueError, match="holds 4 chunks"):
        R.dequantize_sum(q, 2)


# --- producers: out= ------------------------------------------------------------------

@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("op,model_dtype", [(R.quantize, None), (R.quantize_weight_diff, torch.bfloat16)])
def test_producers_write_into_out_what_they_return_without_it(op, model_dtype, rounding):
    n = 2 * 2048 + 5  # unaligned: each chunk pads its own last group
    args = (randn(2 * n, 6),) + (() if model_dtype is None else (randn(2 * n, 7, model_dtype),))
    fmt = (4, 2048)
    _, wire = empty_wire(2, n, *fmt, "cpu")
    assert op(*args, *fmt, rounding, gen(1), out=wire) is wire
    g = gen(1)  # the chunks draw their noise in chunk order from the one generator
    for c in range(2):
        piece = [a[c * n:(c + 1) * n] for a in args]
        assert_same(wire.chunk(c), op(*piece, *fmt, rounding, g))
    flat = R.quantize(torch.zeros(2 * n), *fmt, "nearest")  # a flat out
    assert op(*args, *fmt, rounding, gen(1), out=flat) is flat
    assert_same(flat, op(*args, *fmt, rounding, gen(1)))


def test_hadamard_quantize_into_k_chunks_transforms_each_chunk():
    x = randn(4 * 256, 8, torch.bfloat16)
    _, wire = empty_wire(4, 256, 8, 128, "cpu")
    R.hadamard_quantize(x, 8, 128, 32, "nearest", scale=0.25, out=wire)
    assert_same(wire, R.hadamard_quantize(x, 8, 128, 32, "nearest", scale=0.25))
    _, odd = empty_wire(4, 240, 8, 32, "cpu")  # chunks of 240: not whole blocks of 32
    with pytest.raises(ValueError, match="240 elements is not a multiple of the Hadamard block 32"):
        R.hadamard_quantize(x[:4 * 240], 8, 32, 32, "nearest", out=odd)


@pytest.mark.parametrize("make_out,message", [
    (lambda: R.quantize(torch.zeros(100), 4, 64), "holds 100 elements, this call makes 1000"),
    (lambda: R.quantize(torch.zeros(1000), 8, 64), "8-bit codes in groups of 64, but this call makes 4-bit"),
    (lambda: QuantizedTensor(torch.zeros(500, dtype=torch.uint8), torch.zeros(16), 4, 64, 1000),
     "expected codes \\[512\\]"),
    (lambda: QuantizedTensor(torch.zeros(512, dtype=torch.uint8), torch.zeros(16, dtype=torch.float64),
                             4, 64, 1000), "fp32"),
    (lambda: QuantizedTensor(torch.zeros(1024, dtype=torch.uint8)[::2], torch.zeros(16), 4, 64, 1000),
     "contiguous"),
    (lambda: "not a tensor", "must be a QuantizedTensor"),
])
def test_a_wrong_out_is_one_clear_value_error(make_out, message):
    with pytest.raises(ValueError, match=message):
        R.quantize(torch.zeros(1000), 4, 64, "nearest", out=make_out())


# --- hadamard_quantize_rows: stage in send order, then quantize -------------------------

def _stage(rows, order, start, valid, padded):
    """The plain definition, row by row (independent of reference.stage_rows)."""
    out = torch.zeros(rows.shape[0], padded, dtype=rows.dtype)
    for r in range(rows.shape[0]):
        source = r if order is None else int(order[r])
        out[r, :valid] = rows[source, start:start + valid]
    return out.view(-1)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", [None, (2, 0, 3, 1)])
@pytest.mark.parametrize("start,valid,padded", [(0, 256, 256), (128, 256, 256), (384, 100, 128)])
def test_rows_op_is_hadamard_quantize_of_the_staged_rows(start, valid, padded, order, dtype, rounding):
    rows = randn(4 * 512, 9, dtype).view(4, 512)
    index = None if order is None else torch.tensor(order)
    staged = _stage(rows, index, start, valid, padded)
    assert torch.equal(R.stage_rows(rows, index, start, valid, padded), staged)
    expected = R.hadamard_quantize(staged, 8, 128, 32, rounding, gen(2), scale=0.25)
    assert_same(R.hadamard_quantize_rows(rows, index, start, valid, padded, 8, 128, 32, rounding,
                                         gen(2), 0.25), expected)
    _, wire = empty_wire(2, 2 * padded, 8, 128, "cpu")  # two peers of two rows each
    R.hadamard_quantize_rows(rows, index, start, valid, padded, 8, 128, 32, rounding, gen(2), 0.25,
                             out=wire)
    assert_same(wire, expected)


@pytest.mark.parametrize("args,message", [
    (dict(rows=torch.zeros(8)), "2-D"),
    (dict(rows=torch.zeros(4, 512, dtype=torch.int32)), "float"),
    (dict(rows=torch.zeros(512, 4).T), "stride 1"),
    (dict(valid=300), "valid <= padded"),
    (dict(start=400), "start \\+ valid <= shard"),
    (dict(padded=200, valid=100), "multiple of group_size=128"),
    (dict(order=torch.tensor([0, 1, 2])), "order must be"),
    (dict(order=torch.tensor([0.0, 1, 2, 3])), "order must be"),
    (dict(start=-1), "non-negative"),
])
def test_rows_op_refuses_bad_arguments(args, message):
    call = dict(rows=torch.zeros(4, 512), order=None, start=128, valid=256, padded=256)
    call.update(args)
    with pytest.raises(ValueError, match=message):
        R.hadamard_quantize_rows(call["rows"], call["order"], call["start"], call["valid"],
                                 call["padded"], 8, 128, 32, "nearest")


def test_rows_op_out_chunks_must_be_whole_groups():
    _, out = empty_wire(2, 96, 8, 64, "cpu")  # 2 chunks of 96: not whole groups of 64
    with pytest.raises(ValueError, match="whole groups"):
        R.hadamard_quantize_rows(torch.zeros(3, 128), None, 0, 64, 64, 8, 64, 32, "nearest", out=out)
