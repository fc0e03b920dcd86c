"""Which runner serves a backend and device, and making one (``comm/runner.py``,
``comm/deferring_runner.py``)."""
from __future__ import annotations

import torch

from megatron_sdp4bit.comm.backends import backend_of
from megatron_sdp4bit.comm.deferring_runner import DeferringRunner
from megatron_sdp4bit.comm.runner import InlineRunner, StreamRunner, ThreadRunner


def runner_kind(group, device: torch.device) -> str:
    """``"stream"`` (NCCL on CUDA), ``"thread"`` (gloo) or ``"inline"`` (any other backend:
    the collectives then run on the caller, not overlapped)."""
    backend = backend_of(group, device)
    if backend == "nccl" and torch.device(device).type == "cuda":
        return "stream"
    if backend == "gloo":
        return "thread"
    return "inline"


def make_runner(kind: str, device: torch.device):
    """The runner of ``kind`` (``runner_kind``) for collectives on ``device``."""
    if kind == "stream":
        return StreamRunner(device)
    if kind == "thread":
        return ThreadRunner(device)
    if kind == "inline":
        return InlineRunner()
    if kind == "deferred":
        return DeferringRunner(device)
    raise ValueError(f"unknown runner kind {kind!r}; use 'inline', 'thread', 'stream' or "
                     "'deferred'")
