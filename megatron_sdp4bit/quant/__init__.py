"""Quantization math for SDP4Bit: tensors in, tensors out (no torch.distributed).

One API, two backends chosen by the tensor's device: the torch reference
(``reference.py``, every device, the specification) and Triton kernels
(``triton_ops.py``, CUDA tensors when Triton is importable). Set
``SDP4BIT_QUANT_BACKEND=torch`` to force the reference everywhere.
"""
from __future__ import annotations

import functools
import os

import torch

from megatron_sdp4bit.quant import reference
from megatron_sdp4bit.quant.hadamard import hadamard_transform
from megatron_sdp4bit.quant.packing import pack_codes, unpack_codes
from megatron_sdp4bit.quant.types import QuantizedTensor, codes_per_byte, qmax
from megatron_sdp4bit.quant.wire import (
    SEGMENT_ALIGN,
    empty_wire,
    segment_layout,
    segment_nbytes,
    wire_view,
)

__all__ = [
    "QuantizedTensor", "codes_per_byte", "qmax", "pack_codes", "unpack_codes",
    "hadamard_transform", "quantize", "dequantize", "quantize_weight_diff",
    "dequantize_add_", "hadamard_quantize", "hadamard_quantize_rows",
    "dequantize_sum_requantize", "dequantize_sum", "backend_for",
    "SEGMENT_ALIGN", "segment_layout", "segment_nbytes", "wire_view", "empty_wire",
    "KernelSpec", "warm_up", "prepare", "cuda_runs_reference",
]


@functools.lru_cache(maxsize=None)
def _triton_ops():
    try:
        from megatron_sdp4bit.quant import triton_ops
    except ImportError:  # triton not installed: the reference serves every device
        return None
    return triton_ops


def _triton_unless_forced_off():
    """The Triton ops, or None where they cannot serve (not importable) or must not
    (``SDP4BIT_QUANT_BACKEND=torch``)."""
    if os.environ.get("SDP4BIT_QUANT_BACKEND", "auto") == "torch":
        return None
    return _triton_ops()


def backend_for(t: torch.Tensor):
    """The module implementing the ops for tensor ``t``'s device: Triton on CUDA, and on
    any device inside ``launch_record.recording()``, where its launches are recorded
    rather than run (what the same call on a GPU would launch); the reference elsewhere."""
    ops = _triton_unless_forced_off()
    if ops is not None and (t.is_cuda or ops.launch_record.active()):
        return ops
    return reference


def cuda_runs_reference() -> bool:
    """Whether CUDA tensors get the torch reference (``backend_for``): no Triton, or
    ``SDP4BIT_QUANT_BACKEND=torch``."""
    return _triton_unless_forced_off() is None


def _tensor_of(q_or_t):
    return q_or_t.codes if isinstance(q_or_t, QuantizedTensor) else q_or_t


def _dispatch(name: str):
    def op(first, *args, **kwargs):
        return getattr(backend_for(_tensor_of(first)), name)(first, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = getattr(reference, name).__doc__
    return op


def prepare(name: str, first, *args, **kwargs):
    """Op ``name``'s call ``(first, *args, **kwargs)`` bound, checked and worked out once, on
    the backend of ``first``'s device: returns ``run(generator=None)``, which makes the same
    call again on the same tensors, drawing from ``generator`` (``arguments.api_op``)."""
    return getattr(backend_for(_tensor_of(first)), name).prepare(first, *args, **kwargs)


quantize = _dispatch("quantize")
dequantize = _dispatch("dequantize")
quantize_weight_diff = _dispatch("quantize_weight_diff")
dequantize_add_ = _dispatch("dequantize_add_")
hadamard_quantize = _dispatch("hadamard_quantize")
hadamard_quantize_rows = _dispatch("hadamard_quantize_rows")
dequantize_sum_requantize = _dispatch("dequantize_sum_requantize")
dequantize_sum = _dispatch("dequantize_sum")

from megatron_sdp4bit.quant.warmup import KernelSpec, warm_up  # noqa: E402  (uses the ops above)
