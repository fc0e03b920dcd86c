"""Triton backend of the quantization API: the ops of ``reference.py``, fused.

Same names, signatures, return types and results as the reference: codes and
scales are bit-identical with ``rounding="nearest"`` (but an all-zero group's
scale is always +0, where the reference may give -0); with ``"stochastic"`` the
scales are identical and each code is floor(v + u) with u from Triton's Philox
stream keyed by a seed drawn from ``generator`` and the element's index (so
results are reproducible from the generator's state, but not equal to the
reference's draws). ``dequantize_sum*`` add the chunks in order 0, 1, ..., k-1
in fp32, as the reference does.

Each op is one kernel launch (plus output allocation when no ``out`` is given):
the Hadamard transform, the 1/DP scaling, the weight difference, the send-order
staging of the reduce-scatter and the dequantize-sum-requantize step are fused
into it, and a k-chunk (wire) tensor is read or written by the same launch
(grid axis 1: the chunk). Importing this module raises ImportError when Triton
is missing; the dispatcher in ``quant/__init__.py`` then uses the reference.

The kernels run on CUDA tensors, or on CPU tensors when this module was first
imported with TRITON_INTERPRET=1 (Triton's interpreter, used by the tests).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

import triton  # noqa: F401  (ImportError here tells the dispatcher to use the reference)

from megatron_sdp4bit.quant.reference_stream import empty_quantized
from megatron_sdp4bit.quant.triton_kernels import launch_plan, launch_record
from megatron_sdp4bit.quant.triton_kernels.dequantize_kernel import dequantize_kernel
from megatron_sdp4bit.quant.triton_kernels.quantize_kernel import (
    SOURCE_CHUNKS,
    SOURCE_ROWS,
    SOURCE_TENSOR,
    quantize_kernel,
)
from megatron_sdp4bit.quant.triton_kernels.tile_math import INTERPRETED
from megatron_sdp4bit.quant import reference
from megatron_sdp4bit.quant.argument_contract import api_op
from megatron_sdp4bit.quant.types import QuantizedTensor, codes_per_byte

__all__ = [
    "quantize", "dequantize", "quantize_weight_diff", "dequantize_add_",
    "hadamard_quantize", "hadamard_quantize_rows", "dequantize_sum_requantize", "dequantize_sum",
]

# Every launch: no FMA contraction, no flush-to-zero (see launch_plan.exact_fp_options).
_EXACT = launch_plan.exact_fp_options()


# --- what only this backend needs (the API's contract is quant/argument_contract.py) ---------------

def _check_cuda(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED and not launch_record.active():
        raise ValueError(
            f"the Triton kernels run on CUDA tensors, got a {t.device.type} tensor: call "
            "megatron_sdp4bit.quant (it dispatches by device), or set TRITON_INTERPRET=1 "
            "before the first import of triton_ops to run the kernels on the CPU"
        )


def _output(out: Optional[QuantizedTensor], numel: int, bits: int, group_size: int,
            dtype: torch.dtype, device: torch.device) -> QuantizedTensor:
    """``out`` (checked by the contract), or a new flat QuantizedTensor."""
    return empty_quantized(bits, group_size, numel, dtype, device) if out is None else out


# --- launches ----------------------------------------------------------------------

def _chunk_strides(q: QuantizedTensor, num_chunks: int) -> Tuple[int, int]:
    """(codes bytes, scales) from chunk c to chunk c + 1 of ``q``'s ``num_chunks`` chunks.

    (0, 0) for one chunk: never used then, and a constant keeps the kernel variant
    the same for a flat tensor and a one-segment wire view (Triton specialises on
    the strides' divisibility).
    """
    if num_chunks == 1:
        return 0, 0
    if q.codes.dim() == 2:
        return q.codes.stride(0), q.scales.stride(0)
    n = q.numel // num_chunks
    return n // codes_per_byte(q.bits), n // q.group_size


def _words_aligned(q: QuantizedTensor, num_chunks: int) -> bool:
    """q's codes can be read and written as 32-bit words: every chunk 4-byte aligned."""
    return q.codes.data_ptr() % 4 == 0 and _chunk_strides(q, num_chunks)[0] % 4 == 0


def _codes_bytes(q: QuantizedTensor) -> torch.Tensor:
    """q's codes as the kernels read them: int8 for 8 bits, uint8 bytes when packed
    (received buffers may come as either; the bytes are what counts)."""
    return q.codes.view(torch.int8 if q.bits == 8 else torch.uint8)


def _plan_quantize(out: QuantizedTensor, rounding: str,
                   *, x: Optional[torch.Tensor] = None, y: Optional[torch.Tensor] = None,
                   multiplier: float = 1.0, source: Optional[QuantizedTensor] = None,
                   num_chunks: int = 1, rows: Optional[Tuple] = None,
                   hadamard_block: Optional[int] = None) -> "_KernelCall":
    """The launch that fills ``out`` (flat or k chunks) from a float tensor ``x`` (- ``y``),
    from ``source``'s chunks, or (``rows`` = (order, start, valid, padded)) from rows ``x``."""
    n = out.chunk_numel
    if out.numel == 0:
        return _NO_LAUNCH
    groups = out.num_groups // out.num_chunks
    block, groups_per_program, grid = launch_plan.quantize_tiling(groups, out.group_size,
                                                             out.num_chunks)
    codes_stride, scales_stride = _chunk_strides(out, out.num_chunks)
    src_codes, src_scales, src_strides = out.codes, out.scales, (0, 0)
    src_bits, src_group = 8, 1
    order, row_stride, start, valid, groups_per_row = out.scales, 0, 0, 0, 0
    if source is not None:
        x_view, x_bf16, y_view, y_bf16 = out.scales, False, out.scales, False
        src_codes, src_scales = _codes_bytes(source), source.scales
        src_strides = _chunk_strides(source, num_chunks)
        src_bits, src_group = source.bits, source.group_size
    else:
        x_view, x_bf16 = launch_plan.kernel_view(x)
        y_view, y_bf16 = launch_plan.kernel_view(y) if y is not None else (x_view, False)
    if rows is not None:
        row_order, start, valid, padded = rows
        order = row_order if row_order is not None else order
        row_stride, groups_per_row = x.stride(0), padded // out.group_size
    tail = valid < rows[3] if rows is not None else n % out.group_size != 0
    sizes = [t.element_size() for t in (x_view, y_view)] if source is None else []
    # Every strip of x (and y) starts at an even element: bf16 can be read in words.
    even_starts = (row_stride % 2 == 0 and start % 2 == 0 if rows is not None
                   else out.num_chunks == 1 or n % 2 == 0)
    strips = launch_plan.quantize_strips(
        out.bits, out.group_size, hadamard_block or 0, sizes,
        None if source is None else (src_bits, src_group, _words_aligned(source, num_chunks)),
        _words_aligned(out, out.num_chunks))
    return _KernelCall(
        quantize_kernel, grid, out.codes, rounding == "stochastic",
        [x_view, y_view, float(multiplier),
         src_codes, src_scales, src_strides[0], src_strides[1],
         order, row_stride, start, valid, groups_per_row,
         _codes_bytes(out), out.scales, codes_stride, scales_stride,
         out.scales,  # the seed: drawn per launch, or (nearest) a tensor never read
         n, groups, 0],
        dict(
            SOURCE=(SOURCE_ROWS if rows is not None else
                    SOURCE_TENSOR if source is None else SOURCE_CHUNKS),
            X_BF16=x_bf16, HAS_Y=y is not None, Y_BF16=y_bf16, SCALED=float(multiplier) != 1.0,
            TAIL=tail, SRC_BITS=src_bits, SRC_GROUP=src_group, NUM_CHUNKS=num_chunks,
            HAS_ORDER=rows is not None and rows[0] is not None,
            BITS=out.bits, GROUP=out.group_size, GROUPS_PER_PROGRAM=groups_per_program,
            BLOCK=block, HADAMARD=hadamard_block or 0, STOCHASTIC=rounding == "stochastic",
            STRIPS=strips, X_HALF=x_view.element_size() == 2, Y_HALF=y_view.element_size() == 2,
            X_WORDS=x_bf16 and even_starts and x_view.data_ptr() % 4 == 0,
            Y_WORDS=y_bf16 and even_starts and y_view.data_ptr() % 4 == 0,
            num_warps=launch_plan.num_warps_for(block * groups_per_program), **_EXACT))


def _plan_dequantize(q: QuantizedTensor, out: torch.Tensor, out_stride: int,
                     num_chunks: int = 1, hadamard_block: Optional[int] = None,
                     accumulate: bool = False) -> "_KernelCall":
    """The launch that writes (``accumulate``: adds) into ``out`` the sum of ``q``'s
    ``num_chunks`` chunks (> 1), or each of q's chunks c at ``c * out_stride`` elements
    (``num_chunks`` 1)."""
    written = q.num_chunks if num_chunks == 1 else 1
    numel = q.numel // max(num_chunks, written)
    if numel == 0:
        return _NO_LAUNCH
    out_view, out_bf16 = launch_plan.kernel_view(out)
    codes_stride, scales_stride = _chunk_strides(q, max(num_chunks, written))
    block, grid = launch_plan.dequantize_tiling(numel, hadamard_block or 0, written)
    strips = block % 32 == 0 and launch_plan.dequantize_strips(
        q.bits, q.group_size, hadamard_block or 0, out_view.element_size(),
        _words_aligned(q, max(num_chunks, written)))
    # bf16 read as 32-bit words: every strip (a multiple of 32 into each output chunk)
    # starts 4-byte aligned.
    out_words = out_bf16 and out_view.data_ptr() % 4 == 0 and out_stride % 2 == 0
    return _KernelCall(
        dequantize_kernel, grid, q.codes, False,
        [_codes_bytes(q), q.scales, out_view, numel, codes_stride, scales_stride, out_stride, 0],
        dict(NUM_CHUNKS=num_chunks, BITS=q.bits, GROUP=q.group_size, BLOCK=block,
             HADAMARD=hadamard_block or 0, OUT_BF16=out_bf16, ACCUMULATE=accumulate,
             STRIPS=strips, OUT_HALF=out_view.element_size() == 2, OUT_WORDS=out_words,
             TAIL=numel % 32 != 0, num_warps=launch_plan.num_warps_for(block), **_EXACT))


class _KernelCall:
    """One kernel launch worked out once: ``call(generator)`` launches it (a seed drawn
    from ``generator`` first for stochastic rounding, the only argument that changes)."""

    SEED = quantize_kernel.arg_names.index("seed_ptr")  # the quantize kernel's seed argument

    def __init__(self, kernel, grid, on: torch.Tensor, stochastic: bool, args: list,
                 kwargs: dict) -> None:
        self.kernel, self.grid, self.on = kernel, grid, on
        self.stochastic, self.args, self.kwargs = stochastic, args, kwargs

    def __call__(self, generator: Optional[torch.Generator] = None) -> None:
        args = self.args
        if self.stochastic:
            args = list(args)
            args[self.SEED] = launch_plan.seed_tensor(generator, self.on.device)
        with launch_plan.device_guard(self.on):
            self.kernel[self.grid](*args, **self.kwargs)


def _no_launch(generator: Optional[torch.Generator] = None) -> None:
    return None


_NO_LAUNCH = _no_launch  # an empty tensor: nothing to launch


# --- the API: reference.py's signatures and contract (quant/argument_contract.py), fused ---------
# Every body is ``planned``: it works out the launch and returns (result, launch); the
# decorator launches it, or ``op.prepare`` keeps it for calls that repeat.

@api_op(reference.quantize, planned=True)
def quantize(x, bits, group_size, rounding, generator, out):
    """Group-wise symmetric quantization of ``x`` (flattened), into ``out`` if given."""
    _check_cuda(x)
    flat = launch_plan.flat_input(x)
    result = _output(out, flat.numel(), bits, group_size, x.dtype, x.device)
    return result, _plan_quantize(result, rounding, x=flat)


@api_op(reference.dequantize, planned=True)
def dequantize(q, dtype):
    """Values of ``q`` as a flat tensor of ``q.numel`` elements in ``dtype`` (default q.dtype)."""
    _check_cuda(q.codes)
    out_dtype = dtype or q.dtype
    if out_dtype not in launch_plan.NATIVE_FLOATS and out_dtype != torch.bfloat16:
        values = torch.empty(q.numel, dtype=torch.float32, device=q.device)
        into_fp32 = _plan_dequantize(q, values, q.chunk_numel if q.num_chunks > 1 else 0)
        result = torch.empty(q.numel, dtype=out_dtype, device=q.device)

        def then_cast(generator=None):  # e.g. an integer dtype: as the reference
            into_fp32()
            result.copy_(values)

        return result, then_cast
    out = torch.empty(q.numel, dtype=out_dtype, device=q.device)
    return out, _plan_dequantize(q, out, q.chunk_numel if q.num_chunks > 1 else 0)


@api_op(reference.quantize_weight_diff, planned=True)
def quantize_weight_diff(main_shard, model_shard, bits, group_size, rounding, generator, out):
    """Quantize ``main_shard (fp32) - model_shard (bf16/fp32)``: the qWD payload."""
    _check_cuda(main_shard)
    main, model = launch_plan.flat_input(main_shard), launch_plan.flat_input(model_shard)
    result = _output(out, main.numel(), bits, group_size, torch.float32, main.device)
    return result, _plan_quantize(result, rounding, x=main, y=model)


@api_op(reference.dequantize_add_, planned=True)
def dequantize_add_(base, q):
    """``base += dequantize(q)`` in place, summed in fp32 and rounded once to base's dtype.

    ``base``: ``q.numel`` elements, or for k-chunk ``q`` also a [k, n] tensor
    (any row stride): chunk c is added into base[c] (= flat base[c*n:(c+1)*n]).
    """
    _check_cuda(base)
    if q.numel == 0:
        return base, _NO_LAUNCH
    n = q.chunk_numel
    if tuple(base.shape) == (q.num_chunks, n) and (n < 2 or base.stride(1) == 1):
        target, stride = base, base.stride(0)
    elif base.is_contiguous():
        target, stride = base.view(-1), n
    else:
        raise ValueError(
            "dequantize_add_ updates base in place and needs it contiguous (or [k, n] with "
            "contiguous rows); pass base.contiguous() and copy the result back"
        )
    if base.dtype != torch.bfloat16 and base.dtype not in launch_plan.NATIVE_FLOATS:
        raise ValueError(f"base must be a float tensor, got {base.dtype}")
    return base, _plan_dequantize(q, target, stride if q.num_chunks > 1 else 0, accumulate=True)


@api_op(reference.hadamard_quantize, planned=True)
def hadamard_quantize(x, bits, group_size, hadamard_block, rounding, generator, scale, out):
    """Quantize ``H(scale * x)`` (no transform when ``hadamard_block`` is None).

    ``scale`` folds the 1/DP of an averaging reduce-scatter into the same pass.
    ``x.numel()`` (each chunk of a k-chunk ``out``) must be a multiple of the block.
    """
    _check_cuda(x)
    flat = launch_plan.flat_input(x)
    result = _output(out, flat.numel(), bits, group_size, x.dtype, x.device)
    return result, _plan_quantize(result, rounding, x=flat, multiplier=scale,
                                  hadamard_block=hadamard_block)


@api_op(reference.hadamard_quantize_rows, planned=True)
def hadamard_quantize_rows(rows, order, start, valid, padded, bits, group_size, hadamard_block,
                           rounding, generator, scale, out):
    """``hadamard_quantize`` of the send-order staging of a pipeline chunk, without staging it.

    ``rows``: [P, shard], each row contiguous. The quantized tensor has P *
    ``padded`` elements: row r holds columns [start, start + valid) of
    rows[order[r]] (None = identity), then zeros up to ``padded``. The kernel
    reads each group straight from its source row; a k-chunk ``out`` must have
    chunks of whole groups.
    """
    _check_cuda(rows)
    result = _output(out, rows.shape[0] * padded, bits, group_size, rows.dtype, rows.device)
    return result, _plan_quantize(result, rounding, x=rows, multiplier=scale,
                                  rows=(order, start, valid, padded), hadamard_block=hadamard_block)


@api_op(reference.dequantize_sum_requantize, planned=True)
def dequantize_sum_requantize(q, num_chunks, bits, group_size, rounding, generator, out):
    """Dequantize k received chunks, sum them in fp32, quantize the sum again.

    The step between the two all-to-all hops; bits and group size may differ
    from the input's. One kernel: the sum never goes to memory.
    """
    _check_cuda(q.codes)
    chunk = q.numel // num_chunks
    result = _output(out, chunk, bits, group_size, q.dtype, q.device)
    return result, _plan_quantize(result, rounding, source=q, num_chunks=num_chunks)


@api_op(reference.dequantize_sum, planned=True)
def dequantize_sum(q, num_chunks, inverse_hadamard_block, out):
    """Dequantize k chunks, sum in fp32, then H^-1 per block if asked.

    Returns fp32, or writes (cast) into ``out`` and returns it.
    """
    _check_cuda(q.codes)
    chunk = q.numel // num_chunks
    # The kernel writes straight into a contiguous float ``out``; any other ``out``
    # gets an fp32 result that copy_ casts and strides (one extra pass).
    direct = out is not None and out.is_contiguous() and (
        out.dtype == torch.bfloat16 or out.dtype in launch_plan.NATIVE_FLOATS)
    target = out.view(-1) if direct else torch.empty(chunk, dtype=torch.float32, device=q.device)
    sum_into_target = _plan_dequantize(q, target, 0, num_chunks, inverse_hadamard_block)
    if out is None or direct:
        return (target if out is None else out), sum_into_target

    def then_copy(generator=None):
        sum_into_target()
        out.copy_(target.view(out.shape))

    return out, then_copy
