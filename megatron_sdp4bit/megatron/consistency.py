"""Replica consistency: a digest of the model weights, equal on ranks that agree.

SDP4Bit promises bit-identical weights on every data-parallel rank after every
step; comparing this digest across ranks checks it.
"""
from __future__ import annotations

import hashlib

import torch


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the name and bytes of every parameter, in ``named_parameters`` order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
