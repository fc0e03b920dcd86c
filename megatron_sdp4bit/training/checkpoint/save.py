"""Atomic saves: every rank writes its file into ``iter_N.tmp``; the folder becomes
``iter_N`` only once every file is written and the manifest lists them, and the
tracker file is replaced last. A save stopped at any point leaves the previous
checkpoint as the latest, readable."""
from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from megatron_sdp4bit.training.checkpoint.common import (
    LATEST, CheckpointError, adapter, all_gather, barrier, iter_dir, model_holder, pipeline_stage,
    rank_and_world, rank_file)
from megatron_sdp4bit.training.checkpoint.layout import current_layout, own_buckets
from megatron_sdp4bit.training.checkpoint.manifest import file_digest, write_manifest
from megatron_sdp4bit.training.checkpoint.rng import rng_state


def check_writable(save_dir: str) -> None:
    """Fail before training, not at the first save, when SAVE cannot be written."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(
            f"--save {save_dir} is not writable ({exc.strerror}); choose a directory you can write"
        ) from exc


def _rank_state(iteration: int, model, optimizer, scheduler, extra: Optional[dict]) -> dict:
    sub_optimizers = adapter().sub_optimizers(optimizer)
    return {
        "iteration": iteration,
        "model": model.state_dict() if model_holder()[0] == 0 else None,
        "optimizer": [opt.state_dict() for opt in sub_optimizers],
        "param_state": [adapter().parameter_state_for_save(opt) for opt in sub_optimizers],
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }


def _publish(save_dir: str, tmp: str, final: str, iteration: int) -> None:
    """Rank 0: rename the written folder into place, then point the tracker at it."""
    if os.path.isdir(final):  # re-saving the same iteration: keep the old until the new is in
        shutil.rmtree(final + ".old", ignore_errors=True)
        shutil.move(final, final + ".old")
    os.replace(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)
    latest = os.path.join(save_dir, LATEST)
    with open(latest + ".part", "w") as f:
        f.write(f"{iteration}\n")
    os.replace(latest + ".part", latest)


def save_checkpoint(save_dir: str, iteration: int, model, optimizer, scheduler,
                    extra: Optional[dict] = None, global_batch_size: Optional[int] = None) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory.
    ``global_batch_size`` is recorded in the manifest (see ``current_layout``)."""
    rank, _ = rank_and_world()
    final = iter_dir(save_dir, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
        os.makedirs(tmp)
    barrier()
    path = rank_file(tmp, rank)
    torch.save(_rank_state(iteration, model, optimizer, scheduler, extra), path + ".part")
    os.replace(path + ".part", path)
    entries = all_gather((os.path.basename(path), *file_digest(path)))  # also: all have written
    stage_buckets = dict(all_gather((pipeline_stage(), own_buckets(optimizer))))
    if rank == 0:
        write_manifest(tmp, iteration, current_layout(model, optimizer, stage_buckets, global_batch_size),
                       entries)
        _publish(save_dir, tmp, final, iteration)
    barrier()
    return final
