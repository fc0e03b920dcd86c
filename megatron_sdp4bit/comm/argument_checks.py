"""Argument checks shared by the collectives: clear errors before any communication."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_tensors(**tensors) -> None:
    """Each named argument must be a contiguous floating-point tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not supported; use float32 or bfloat16")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; call .contiguous() first")
