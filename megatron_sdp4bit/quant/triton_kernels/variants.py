"""The kernel variants to compile without a GPU: the collectives' real calls, then the rest.

Each variant is a call of a ``triton_ops`` op on small CPU tensors shaped like
the call it stands for (dtypes, bits, group sizes, chunk counts, wire layouts,
pointer alignment and integer divisibility) that launches one kernel: recorded
with ``launch_record.recording()``, it gives exactly the kernel variant the same
call on a GPU compiles. The shapes are a few programs' worth, enough for the default
tile choice (``launch.TUNING``).

- ``REAL_CALLS``: what the collectives launch with the default configuration
  (qWD 4-bit G=2048; TLq-HS 8-bit G=128 intra, 4-bit G=128 inter, Hadamard 32;
  stochastic rounding), for L, N or P = 2, 4 and 8 chunks where a chunk count is
  compiled in, bf16 and fp32 buffers; and the rows ``scripts/bench_quant.py``
  times. The instruction-budget target (docs/performance.md) applies to these.
- ``COVERAGE``: the other branches of the kernels (2-bit, tails, sliced groups,
  the requantize tilings, Hadamard block 256, nearest rounding), compiled so the
  compile check sees every branch.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from megatron_sdp4bit.quant import reference as R
from megatron_sdp4bit.quant import triton_ops as T
from megatron_sdp4bit.quant.types import QuantizedTensor
from megatron_sdp4bit.quant.wire import empty_wire

Variant = Tuple[str, Callable[[], object]]

WEIGHTS, GRADS, GRADS_INTER, BLOCK = 2048, 128, 128, 32
CHUNK_COUNTS = (2, 4, 8)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _floats(numel: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)


def _wire(chunks: int, chunk_numel: int, bits: int, group: int) -> QuantizedTensor:
    q = empty_wire(chunks, chunk_numel, bits, group, "cpu")[1]
    q.codes.zero_()
    q.scales.zero_()
    return q


def _flat(numel: int, bits: int, group: int) -> QuantizedTensor:
    """A flat quantized input, made by the reference (no launch to record)."""
    return R.quantize(_floats(numel), bits, group, "nearest")


def _rows_call(dtype, chunks: int, valid: int, rounding="stochastic", bits=8, group=GRADS,
               block: Optional[int] = BLOCK) -> Callable[[], object]:
    """The reduce-scatter's first quantize: P = 8 rows (shards of 16 Ki), the chunk at
    column 4 Ki in send order, to ``chunks`` peers (L segments of 8 / L rows)."""
    rows, padded = 8, 4096

    def call():
        shards = torch.zeros(rows, 4 * padded, dtype=dtype)
        order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
        out = _wire(chunks, rows * padded // chunks, bits, group)
        return T.hadamard_quantize_rows(shards, order, padded, valid, padded, bits, group, block,
                                        rounding, _gen(), 1 / rows, out=out)

    return call


def _requantize_call(chunks: int, in_bits=8, bits=4, out_chunks: int = 2) -> Callable[[], object]:
    """Between the hops: L received segments of 8 Ki, N send segments."""
    def call():
        received = _wire(chunks, 8192, in_bits, GRADS)
        out = _wire(out_chunks, 8192 // out_chunks, bits, GRADS_INTER)
        return T.dequantize_sum_requantize(received, chunks, bits, GRADS_INTER, "stochastic",
                                           _gen(), out=out)
    return call


def _final_sum_call(chunks: int, bits: int, dtype) -> Callable[[], object]:
    """The last hop: N (or P) received segments summed, inverse Hadamard, into the output."""
    def call():
        received = _wire(chunks, 8192, bits, GRADS_INTER)
        return T.dequantize_sum(received, chunks, BLOCK, out=torch.empty(8192, dtype=dtype))
    return call


def _weight_diff_call(model_dtype) -> Callable[[], object]:
    def call():
        out = _wire(1, 4 * WEIGHTS, 4, WEIGHTS)  # this rank's send segment
        return T.quantize_weight_diff(_floats(4 * WEIGHTS), _floats(4 * WEIGHTS, model_dtype), 4,
                                      WEIGHTS, "stochastic", _gen(), out=out)
    return call


def _apply_call(dtype, sliced: bool = False) -> Callable[[], object]:
    """Every rank's dequantized differences added into the model buffer: P = 4 shards
    in one launch, the whole shards (flat base) or a slice of each ([P, n] rows)."""
    def call():
        received = _wire(4, 4 * WEIGHTS, 4, WEIGHTS)
        if sliced:
            base = torch.zeros(4, 12 * WEIGHTS, dtype=dtype)[:, 4 * WEIGHTS: 8 * WEIGHTS]
        else:
            base = torch.zeros(4 * 4 * WEIGHTS, dtype=dtype)
        return T.dequantize_add_(base, received)
    return call


REAL_CALLS: List[Variant] = [
    ("grads: rows -> hadamard 8-bit G=128 H=32, fp32 rows, send order", _rows_call(torch.float32, 4, 4096)),
    ("grads: rows -> hadamard 8-bit G=128 H=32, bf16 rows, send order", _rows_call(torch.bfloat16, 4, 4096)),
    ("grads: rows -> hadamard 8-bit, fp32 rows, last chunk (padding)", _rows_call(torch.float32, 4, 1000)),
    ("grads: rows -> hadamard 8-bit, bf16 rows, last chunk (padding)", _rows_call(torch.bfloat16, 4, 1000)),
    *[(f"grads: dequantize-sum-requantize 8->4 G=128, {k} chunks", _requantize_call(k))
      for k in CHUNK_COUNTS],
    *[(f"grads: dequantize_sum 4-bit + inverse H=32, {k} chunks -> fp32",
       _final_sum_call(k, 4, torch.float32)) for k in CHUNK_COUNTS],
    ("grads: dequantize_sum 4-bit + inverse H=32, 4 chunks -> bf16",
     _final_sum_call(4, 4, torch.bfloat16)),
    *[(f"grads (one node): dequantize_sum 8-bit + inverse H=32, {k} chunks -> fp32",
       _final_sum_call(k, 8, torch.float32)) for k in CHUNK_COUNTS],
    ("weights: quantize_weight_diff 4-bit G=2048, fp32 - bf16", _weight_diff_call(torch.bfloat16)),
    ("weights: quantize_weight_diff 4-bit G=2048, fp32 - fp32", _weight_diff_call(torch.float32)),
    ("weights: dequantize_add_ 4-bit G=2048, 4 chunks into bf16", _apply_call(torch.bfloat16)),
    ("weights: dequantize_add_ 4-bit G=2048, 4 chunks into [4, n] bf16 rows",
     _apply_call(torch.bfloat16, sliced=True)),
    ("weights: dequantize_add_ 4-bit G=2048, 4 chunks into fp32", _apply_call(torch.float32)),
    ("weights (qW): quantize 4-bit G=2048 fp32 stochastic",
     lambda: T.quantize(_floats(4 * WEIGHTS), 4, WEIGHTS, "stochastic", _gen(),
                        out=_wire(1, 4 * WEIGHTS, 4, WEIGHTS))),
    ("weights (qW): dequantize 4-bit G=2048, 4 chunks -> fp32",
     lambda: T.dequantize(_wire(4, 4 * WEIGHTS, 4, WEIGHTS), torch.float32)),
    # scripts/bench_quant.py's rows (flat tensors), and the bf16-input quantizers.
    ("bench: quantize 4-bit fp32 stochastic G=2048",
     lambda: T.quantize(_floats(4 * WEIGHTS), 4, WEIGHTS, "stochastic", _gen())),
    ("bench: quantize 4-bit fp32 nearest G=2048",
     lambda: T.quantize(_floats(4 * WEIGHTS), 4, WEIGHTS, "nearest")),
    ("bench: quantize 4-bit bf16 stochastic G=2048",
     lambda: T.quantize(_floats(4 * WEIGHTS, torch.bfloat16), 4, WEIGHTS, "stochastic", _gen())),
    ("bench: dequantize 4-bit G=2048 -> fp32", lambda: T.dequantize(_flat(4 * WEIGHTS, 4, WEIGHTS))),
    ("bench: hadamard 8-bit fp32 G=128 H=32 stochastic",
     lambda: T.hadamard_quantize(_floats(8192), 8, GRADS, BLOCK, "stochastic", _gen(), 0.25)),
    ("bench: hadamard 8-bit bf16 G=128 H=32 stochastic",
     lambda: T.hadamard_quantize(_floats(8192, torch.bfloat16), 8, GRADS, BLOCK, "stochastic",
                                 _gen(), 0.25)),
    *[(f"bench: dequantize-sum-requantize 8->4 G=128, {k} chunks (flat)",
       lambda k=k: T.dequantize_sum_requantize(_flat(k * 8192, 8, GRADS), k, 4, GRADS_INTER,
                                               "stochastic", _gen())) for k in (4, 8)],
    ("bench: dequantize_sum 4-bit G=128 + inverse H=32, 4 chunks (flat)",
     lambda: T.dequantize_sum(_flat(4 * 8192, 4, GRADS_INTER), 4, BLOCK)),
]

COVERAGE: List[Variant] = [
    ("quantize 2-bit fp32 nearest, tail",
     lambda: T.quantize(_floats(8192 - 3), 2, 64, "nearest")),
    ("hadamard 8-bit block 256 nearest",
     lambda: T.hadamard_quantize(_floats(8192), 8, 256, 256, "nearest")),
    ("quantize sliced group (two passes), Hadamard 32",
     lambda: T.hadamard_quantize(_floats(65536), 4, 32768, BLOCK, "stochastic", _gen())),
    ("rows -> quantize 4-bit G=128, no Hadamard, nearest",
     _rows_call(torch.float32, 2, 4096, "nearest", 4, 128, None)),
    ("dequantize-sum-requantize 4->4 bits, sliced group of 10000",
     lambda: T.dequantize_sum_requantize(_flat(4 * 2 * 10000 + 4 * 160, 4, 16), 4, 4, 10000,
                                         "nearest")),
    ("dequantize-sum-requantize 2->4 bits, group 3000 per program",
     lambda: T.dequantize_sum_requantize(_flat(4 * 6000 + 32, 2, 8), 4, 4, 3000, "nearest")),
    ("dequantize-sum-requantize 8->8 bits, groups of 96",
     lambda: T.dequantize_sum_requantize(_flat(4 * 96 * 64, 8, 32), 4, 8, 96, "nearest")),
    ("dequantize 2-bit -> fp16", lambda: T.dequantize(_flat(8192, 2, 64), torch.float16)),
    ("dequantize 4-bit G=128 -> bf16", lambda: T.dequantize(_flat(8192, 4, 128), torch.bfloat16)),
]
