"""Buffers a collective keeps from one call to the next.

A quantized collective needs send and receive buffers for every hop. Allocating
them on every call costs allocator work and, on a GPU, fragments the cache; the
reference fork allocates them once. A ``Workspace`` is that once: named byte
buffers that grow to the largest request and are then reused. The caller decides
how far one is shared, which is what makes reuse safe: a buffer may only be
handed to the next call once the collective that used it has completed. The
patch layer gives each bucket of a bucket group its own gradient workspace (the
buckets of a group are in flight together; groups are completed one before the
next starts) and each bucket its own weight workspace when gathers overlap the
forward pass (all of them may be in flight), one shared one when they do not.

Inside one reduce-scatter the chunks of the pipeline take turns on two slots per
buffer: chunk i + 2 reuses chunk i's buffers, which are done by then (chunk i's
hops are waited before chunk i + 1's second hop starts; see ``gradients.py``).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


class Workspace:
    """Named uint8 buffers, each as large as the largest request made for its name."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, str], torch.Tensor] = {}

    def buffer(self, name: str, nbytes: int, device) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` on ``device``: the start of the buffer kept
        under ``name`` (a larger request replaces it; contents are undefined)."""
        key = (name, str(torch.device(device)))
        kept = self._buffers.get(key)
        if kept is None or kept.numel() < nbytes:
            kept = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._buffers[key] = kept
        return kept[:nbytes]

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(buffer.numel() for buffer in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
