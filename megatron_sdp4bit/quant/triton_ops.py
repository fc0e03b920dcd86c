"""Triton backend of the quantization API: the ops of ``reference.py``, fused.

Same names, signatures, return types and results as the reference: codes and
scales are bit-identical with ``rounding="nearest"`` (but an all-zero group's
scale is always +0, where the reference may give -0); with ``"stochastic"`` the
scales are identical and each code is floor(v + u) with u from Triton's Philox
stream keyed by a seed drawn from ``generator`` (so results are reproducible
from the generator's state, but not equal to the reference's draws).
``dequantize_sum*`` add the chunks in order 0, 1, ..., k-1 in fp32, as the
reference does.

Each op is one kernel launch (plus output allocation): the Hadamard transform,
the 1/DP scaling, the weight difference and the dequantize-sum-requantize step
are fused into it. Importing this module raises ImportError when Triton is
missing; the dispatcher in ``quant/__init__.py`` then uses the reference.

The kernels run on CUDA tensors, or on CPU tensors when this module was first
imported with TRITON_INTERPRET=1 (Triton's interpreter, used by the tests).
"""
from __future__ import annotations

from typing import Optional

import torch

import triton  # noqa: F401  (ImportError here tells the dispatcher to use the reference)

from megatron_sdp4bit.quant.triton_kernels import launch
from megatron_sdp4bit.quant.triton_kernels.dequantize_kernel import dequantize_kernel
from megatron_sdp4bit.quant.triton_kernels.quantize_kernel import (
    SOURCE_CHUNKS,
    SOURCE_TENSOR,
    quantize_kernel,
)
from megatron_sdp4bit.quant.triton_kernels.tile_math import INTERPRETED
from megatron_sdp4bit.quant.types import (
    QuantizedTensor,
    check_format,
    check_group_size,
    check_hadamard_block,
    check_hadamard_group,
    check_same_numel,
    num_groups,
)

__all__ = [
    "quantize", "dequantize", "quantize_weight_diff", "dequantize_add_",
    "hadamard_quantize", "dequantize_sum_requantize", "dequantize_sum",
]

# Every launch: no FMA contraction, no flush-to-zero (see launch.exact_fp_options).
_EXACT = launch.exact_fp_options()


# --- argument checks -----------------------------------------------------------------

def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"tensors are on different devices: {device} and {t.device}")
    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"the Triton kernels run on CUDA tensors, got a {device.type} tensor: call "
            "megatron_sdp4bit.quant (it dispatches by device), or set TRITON_INTERPRET=1 "
            "before the first import of triton_ops to run the kernels on the CPU"
        )


def _check_quantized(q: QuantizedTensor) -> None:
    """q's codes and scales have the layout QuantizedTensor documents."""
    if not isinstance(q, QuantizedTensor):
        raise ValueError(f"expected a QuantizedTensor, got {type(q).__name__}")
    check_group_size(q.group_size, q.bits)
    if q.codes.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"codes must be uint8 (or int8) bytes, got {q.codes.dtype}")
    expected = QuantizedTensor.codes_nbytes(q.numel, q.bits, q.group_size)
    if q.codes.numel() != expected:
        raise ValueError(
            f"codes hold {q.codes.numel()} bytes; {q.numel} elements of {q.bits} bits in "
            f"groups of {q.group_size} need {expected}"
        )
    if q.scales.dtype != torch.float32 or q.scales.numel() != q.num_groups:
        raise ValueError(
            f"scales must be {q.num_groups} fp32 values, got {q.scales.numel()} {q.scales.dtype}"
        )
    if not (q.codes.is_contiguous() and q.scales.is_contiguous()):
        raise ValueError("codes and scales must be contiguous; call .contiguous() on them")
    _check_device(q.codes, q.scales)


def _check_chunks(q: QuantizedTensor, num_chunks: int) -> int:
    """Elements per chunk (same rules and messages as the reference)."""
    if not isinstance(num_chunks, int) or num_chunks <= 0 or q.numel % num_chunks:
        raise ValueError(f"{q.numel} elements cannot be split into {num_chunks} equal chunks")
    chunk = q.numel // num_chunks
    if chunk % q.group_size:
        raise ValueError(
            f"chunk of {chunk} elements is not a multiple of group_size={q.group_size}; "
            "chunks must start on a group boundary"
        )
    return chunk


# --- launches ----------------------------------------------------------------------

def _empty_quantized(bits: int, group_size: int, numel: int, dtype: torch.dtype,
                     device: torch.device) -> QuantizedTensor:
    return QuantizedTensor(
        codes=torch.empty(QuantizedTensor.codes_nbytes(numel, bits, group_size),
                          dtype=torch.int8 if bits == 8 else torch.uint8, device=device),
        scales=torch.empty(num_groups(numel, group_size), dtype=torch.float32, device=device),
        bits=bits, group_size=group_size, numel=numel, dtype=dtype,
    )


def _codes_bytes(q: QuantizedTensor) -> torch.Tensor:
    """q's codes as the kernels read them: int8 for 8 bits, uint8 bytes when packed
    (received buffers may come as either; the bytes are what counts)."""
    return q.codes.view(torch.int8 if q.bits == 8 else torch.uint8)


def _launch_quantize(out: QuantizedTensor, rounding: str, generator: Optional[torch.Generator],
                     *, x: Optional[torch.Tensor] = None, y: Optional[torch.Tensor] = None,
                     multiplier: float = 1.0, source: Optional[QuantizedTensor] = None,
                     num_chunks: int = 1, hadamard_block: Optional[int] = None) -> QuantizedTensor:
    """Fill ``out`` (allocated) from a float tensor ``x`` (- ``y``) or from ``source``'s chunks."""
    if out.numel == 0:
        return out
    device = out.codes.device
    seed = (launch.seed_tensor(generator, device) if rounding == "stochastic"
            else out.scales)  # never read: the pointer argument just needs a tensor
    block, groups_per_program, grid = launch.quantize_tiling(out.num_groups, out.group_size)
    if source is None:
        x_view, x_bf16 = launch.kernel_view(x)
        y_view, y_bf16 = launch.kernel_view(y) if y is not None else (x_view, False)
        src_codes, src_scales, src_bits, src_group = out.codes, out.scales, 8, 1
    else:
        x_view, x_bf16, y_view, y_bf16 = out.scales, False, out.scales, False
        src_codes, src_scales = _codes_bytes(source), source.scales
        src_bits, src_group = source.bits, source.group_size
    with launch.device_guard(out.codes):
        quantize_kernel[grid](
            x_view, y_view, float(multiplier),
            src_codes, src_scales, num_chunks, out.numel,
            out.codes, out.scales, seed,
            out.numel, out.num_groups,
            SOURCE=SOURCE_TENSOR if source is None else SOURCE_CHUNKS,
            X_BF16=x_bf16, HAS_Y=y is not None, Y_BF16=y_bf16, SCALED=float(multiplier) != 1.0,
            TAIL=out.numel % out.group_size != 0,
            SRC_BITS=src_bits, SRC_GROUP=src_group,
            BITS=out.bits, GROUP=out.group_size, GROUPS_PER_PROGRAM=groups_per_program,
            BLOCK=block, HADAMARD=hadamard_block or 0, STOCHASTIC=rounding == "stochastic",
            num_warps=launch.num_warps_for(block * groups_per_program), **_EXACT,
        )
    return out


def _launch_dequantize(q: QuantizedTensor, out: torch.Tensor, numel: int, num_chunks: int = 1,
                       hadamard_block: Optional[int] = None, accumulate: bool = False) -> torch.Tensor:
    """Write (or with ``accumulate`` add) the chunk sum of ``q`` into contiguous ``out``."""
    if numel == 0:
        return out
    out_view, out_bf16 = launch.kernel_view(out)
    block, grid = launch.dequantize_tiling(numel, hadamard_block or 0)
    with launch.device_guard(q.codes):
        dequantize_kernel[grid](
            _codes_bytes(q), q.scales, out_view, numel, num_chunks, numel,
            BITS=q.bits, GROUP=q.group_size, BLOCK=block, HADAMARD=hadamard_block or 0,
            OUT_BF16=out_bf16, ACCUMULATE=accumulate,
            num_warps=launch.num_warps_for(block), **_EXACT,
        )
    return out


# --- the API (same as reference.py) --------------------------------------------------

def quantize(
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 2048,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
) -> QuantizedTensor:
    """Group-wise symmetric quantization of ``x`` (flattened)."""
    check_format(bits, group_size, rounding)
    _check_device(x)
    flat = launch.flat_input(x)
    out = _empty_quantized(bits, group_size, flat.numel(), x.dtype, x.device)
    return _launch_quantize(out, rounding, generator, x=flat)


def dequantize(q: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Values of ``q`` as a flat tensor of ``q.numel`` elements in ``dtype`` (default q.dtype)."""
    _check_quantized(q)
    out_dtype = dtype or q.dtype
    if out_dtype not in launch.NATIVE_FLOATS and out_dtype != torch.bfloat16:
        return dequantize(q, torch.float32).to(out_dtype)  # e.g. an integer dtype: as the reference
    out = torch.empty(q.numel, dtype=out_dtype, device=q.device)
    return _launch_dequantize(q, out, q.numel)


def quantize_weight_diff(
    main_shard: torch.Tensor,
    model_shard: torch.Tensor,
    bits: int = 4,
    group_size: int = 2048,
    rounding: str = "stochastic",
    generator: Optional[torch.Generator] = None,
) -> QuantizedTensor:
    """Quantize ``main_shard (fp32) - model_shard (bf16/fp32)``: the qWD payload."""
    check_format(bits, group_size, rounding)
    check_same_numel("main shard", main_shard, "model shard", model_shard.numel())
    _check_device(main_shard, model_shard)
    main, model = launch.flat_input(main_shard), launch.flat_input(model_shard)
    out = _empty_quantized(bits, group_size, main.numel(), torch.float32, main.device)
    return _launch_quantize(out, rounding, generator, x=main, y=model)


def dequantize_add_(base: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """``base += dequantize(q)`` in place, summed in fp32 and rounded once to base's dtype."""
    check_same_numel("base", base, "the quantized tensor", q.numel)
    _check_quantized(q)
    _check_device(base, q.codes)
    if q.numel == 0:
        return base
    if not base.is_contiguous():
        raise ValueError(
            "dequantize_add_ updates base in place and needs it contiguous; "
            "pass base.contiguous() and copy the result back"
        )
    if base.dtype != torch.bfloat16 and base.dtype not in launch.NATIVE_FLOATS:
        raise ValueError(f"base must be a float tensor, got {base.dtype}")
    _launch_dequantize(q, base.view(-1), q.numel, accumulate=True)
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
    check_format(bits, group_size, rounding)
    if hadamard_block is not None:
        check_hadamard_group(group_size, hadamard_block)
        if x.numel() % hadamard_block:
            raise ValueError(
                f"{x.numel()} elements is not a multiple of the Hadamard block {hadamard_block}"
            )
    _check_device(x)
    flat = launch.flat_input(x)
    out = _empty_quantized(bits, group_size, flat.numel(), x.dtype, x.device)
    return _launch_quantize(out, rounding, generator, x=flat, multiplier=scale,
                            hadamard_block=hadamard_block)


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
    from the input's. One kernel: the sum never goes to memory.
    """
    check_format(bits, group_size, rounding)
    _check_quantized(q)
    chunk = _check_chunks(q, num_chunks)
    out = _empty_quantized(bits, group_size, chunk, q.dtype, q.device)
    return _launch_quantize(out, rounding, generator, source=q, num_chunks=num_chunks)


def dequantize_sum(
    q: QuantizedTensor,
    num_chunks: int,
    inverse_hadamard_block: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dequantize k chunks, sum in fp32, then H^-1 per block if asked.

    Returns fp32, or writes (cast) into ``out`` and returns it.
    """
    _check_quantized(q)
    chunk = _check_chunks(q, num_chunks)
    if inverse_hadamard_block is not None:
        check_hadamard_block(inverse_hadamard_block)
        if chunk % inverse_hadamard_block:
            raise ValueError(
                f"hadamard_transform: {chunk} elements is not a multiple of "
                f"block={inverse_hadamard_block}; pad the input to a multiple of the block"
            )
    if out is not None:
        if out.numel() != chunk:
            raise ValueError(f"out has {out.numel()} elements, the sum has {chunk}")
        _check_device(out, q.codes)
    # The kernel writes straight into a contiguous float ``out``; any other ``out``
    # gets an fp32 result that copy_ casts and strides (one extra pass).
    direct = out is not None and out.is_contiguous() and (
        out.dtype == torch.bfloat16 or out.dtype in launch.NATIVE_FLOATS)
    target = out.view(-1) if direct else torch.empty(chunk, dtype=torch.float32, device=q.device)
    _launch_dequantize(q, target, chunk, num_chunks, inverse_hadamard_block)
    if out is None:
        return target
    if not direct:
        out.copy_(target.view(out.shape))
    return out
