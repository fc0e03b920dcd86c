"""Printing from a job of many ranks: what every rank knows alike is said once, by rank 0."""
from __future__ import annotations

import torch


def is_rank0() -> bool:
    """Rank 0 of the job, or the only process when there is no process group."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def log0(*args) -> None:
    if is_rank0():
        print(*args, flush=True)
