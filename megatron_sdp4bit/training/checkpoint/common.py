"""What every part of the checkpoint package shares: names on disk, this rank's place,
the collectives the ranks agree through, and the one error type."""
from __future__ import annotations

import os
import re
from typing import Tuple

import torch
from megatron.core import parallel_state

from megatron_sdp4bit.megatron.adapters import current_adapter

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
ITER_DIR = re.compile(r"^iter_(\d{7,})$")
RANK_FILE = re.compile(r"^rank_\d{5}\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; raised on every rank alike."""


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def rank_and_world() -> Tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def model_holder() -> Tuple[int, int]:
    """(this rank's rank among the ranks that hold the same model weights, the global
    rank of the first of them): that rank's file holds the weights of this rank's model
    shard. They are the data-parallel group; with expert parallelism the
    expert-data-parallel group (data-parallel ranks of one expert-parallel rank), as the
    data-parallel rank 0 of the others holds other experts."""
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            group, rank = (parallel_state.get_expert_data_parallel_group(),
                           parallel_state.get_expert_data_parallel_rank())
        else:
            group, rank = parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_rank()
        return rank, torch.distributed.get_process_group_ranks(group)[0]
    return rank_and_world()[0], 0


def pipeline_stage() -> str:
    """This rank's pipeline stage, as a JSON key: stages hold different layers, so
    their optimizer buckets differ (TP and DP ranks of a stage share a layout)."""
    if parallel_state.model_parallel_is_initialized():
        return str(parallel_state.get_pipeline_model_parallel_rank())
    return "0"


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_gather(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    out = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def adapter():
    """megatron-core's checkpoint quirks are version-specific: the patch layer's
    adapter for the installed release knows them."""
    return current_adapter()


def first_line(exc: BaseException) -> str:
    """An exception's first line, or its type's name when it has no message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
