"""Replica consistency: data-parallel ranks must hold bit-identical weights.

SDP4Bit promises it after every step (every rank applies the same dequantized
differences). ``weights_sha256`` digests a whole model, for tests and the driver's
hash; ``check_replicas`` is the run-time check the layer makes every
``check_interval`` steps: a digest per bucket, one all-reduce for all of them,
one host read, and on a mismatch the buckets and ranks named.
"""
from __future__ import annotations

import hashlib
from typing import List, Sequence, Tuple

import torch


class ReplicaMismatch(RuntimeError):
    """Data-parallel replicas hold different weights: training cannot go on."""


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the name and bytes of every parameter, in ``named_parameters`` order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def buffer_digest(buffer: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the buffer's bits, on its device (no host read).

    Any change of one element changes the first; the second (every 7th word)
    catches most that cancel in the first. Not a cryptographic hash: it detects
    drift and corruption, not an adversary.
    """
    flat = buffer.detach().reshape(-1)
    words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 \
        else flat.view(torch.uint8)
    return torch.stack([words.sum(dtype=torch.int64), words[::7].sum(dtype=torch.int64)])


def check_replicas(buffers: Sequence[Tuple[str, torch.Tensor]], group, iteration: int) -> None:
    """Raise ``ReplicaMismatch`` on every rank of ``group`` unless all hold equal buffers.

    Collective over ``group``: every rank must call it with the same buffer names.
    """
    if not buffers:
        return
    mine = torch.stack([buffer_digest(buffer) for _, buffer in buffers])  # [buckets, 2]
    extremes = torch.cat([mine, -mine])
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    highest, lowest = extremes[:len(buffers)], -extremes[len(buffers):]
    if bool(torch.equal(highest, lowest)):  # the check's one host read
        return
    # Some bucket differs somewhere (every rank sees it): find where, then stop.
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(everyone, mine, group=group)
    ranks = torch.distributed.get_process_group_ranks(group)
    raise ReplicaMismatch(_describe(buffers, everyone, ranks, iteration))


def _describe(buffers, digests: List[torch.Tensor], ranks: List[int], iteration: int) -> str:
    parts = []
    for index, (name, _) in enumerate(buffers):
        holders = {}
        for rank, digest in zip(ranks, digests):
            holders.setdefault(tuple(digest[index].tolist()), []).append(rank)
        if len(holders) > 1:
            groups = sorted(holders.values(), key=len, reverse=True)
            parts.append(f"{name}: " + " vs ".join(f"ranks {g}" for g in groups))
    return (f"data-parallel replicas hold different weights after {iteration} steps "
            f"({'; '.join(parts)}). The ranks must train identical copies; stopping so that no "
            "checkpoint of diverged weights is written. Resume from the last checkpoint; if it "
            "happens again, report it with this line.")
