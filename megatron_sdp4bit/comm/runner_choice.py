"""Which runner serves a backend and device, and making one (``comm/runner.py``,
``comm/deferring_runner.py``)."""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

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


def runner_refusal(requested: str, backend: str, device_type: str) -> Optional[str]:
    """Why the runner ``SDP4BitConfig.runner`` names cannot serve collectives of ``backend``
    on ``device_type`` tensors (``"cuda"`` or ``"cpu"``), or None. A worker thread runs
    gloo's collectives only (``ThreadRunner`` uses private twins of gloo groups); a side
    stream is a CUDA stream. ``auto``, ``inline`` and the deferring runner run anywhere
    (without CUDA the deferring runner's stages run on the caller, at the later calls)."""
    if requested == "thread" and backend != "gloo":
        return f"a worker thread runs gloo's collectives, and this job's run on {backend}"
    if requested == "stream" and device_type != "cuda":
        return f"its side stream is a CUDA stream, and this job's gradients are on {device_type}"
    return None


def requested_kind(requested: str, group, device: torch.device) -> str:
    """The runner kind ``SDP4BitConfig.runner`` asks for on this group's backend and device:
    ``"auto"`` is ``runner_kind``'s choice, any other kind is taken as asked. Raises
    ``ValueError`` (``runner_refusal``'s reason) where it cannot run."""
    if requested == "auto":
        return runner_kind(group, device)
    why = runner_refusal(requested, backend_of(group, device), torch.device(device).type)
    if why is not None:
        raise ValueError(why)
    return requested


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


def check_same_kind_everywhere(kind: str) -> None:
    """Raise on every rank, in one line, unless every rank of the world chose ``kind``
    (a world collective; every rank calls it at the same point). Runners differ in the
    buckets they take in one chunk and in when they issue each stage: ranks on different runners would send
    all-to-alls of other sizes, or in another order, to one another, and hang or sum
    garbage. The kind hangs on the backend and on ``CUDA_DEVICE_MAX_CONNECTIONS``
    (``megatron/background.py``), which a launcher may set on some nodes only."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, kind)
    if len(set(everyone)) == 1:
        return
    ranks = defaultdict(list)
    for rank, theirs in enumerate(everyone):
        ranks[theirs].append(rank)
    found = "; ".join(f"{theirs!r} on ranks {_spans(members)}" for theirs, members in ranks.items())
    raise RuntimeError(
        f"SDP4Bit: the ranks chose different runners for the quantized collectives ({found}), "
        "whose collectives would not match; give every rank the same backend and the same "
        "CUDA_DEVICE_MAX_CONNECTIONS (1 on every rank, or on none)")


def _spans(ranks: list) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans = [[ranks[0], ranks[0]]]
    for rank in ranks[1:]:
        if rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(f"{first}" if first == last else f"{first}-{last}" for first, last in spans)
