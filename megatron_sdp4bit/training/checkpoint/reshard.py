"""Loading a checkpoint saved with another data-parallel size.

The model comes from rank 0's file; the optimizer shards are cut from the saved
ranks' files that overlap this rank's (``adapter.reshard_parameter_state``:
megatron's own dp_reshardable arithmetic, then megatron's loader); the layer's
exact fp32 main shards (fp32 params under qWD) likewise. The rest (scheduler, RNG
states, the optimizer's step and hyper-parameters) is the same on every saved
rank and is read from this rank's file, or rank 0's for a rank the saved run did
not have. The SDP4Bit quantizer streams are per rank: a rank the saved run had
continues its own, a new rank starts its streams from the seed.
"""
from __future__ import annotations

import torch

from typing import Optional

from megatron_sdp4bit.training.checkpoint.common import CheckpointError, adapter, first_line, rank_and_world, rank_file
from megatron_sdp4bit.training.checkpoint.model_record import load_model
from megatron_sdp4bit.training.checkpoint.overrides import align_saved_groups, group_settings, settle_schedule
from megatron_sdp4bit.training.checkpoint.rng_state import set_rng_state


def read_rank_file(path: str, mmap: bool = False) -> dict:
    """One rank's saved state; a missing or damaged file is a ``CheckpointError`` naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing") from exc
    except Exception as exc:  # a damaged file: torch's zip reader or unpickler
        raise CheckpointError(f"{path} is unreadable, the checkpoint is damaged ({first_line(exc)})") from exc


class SavedRanks:
    """The saved run's rank files, each read once, on demand, memory-mapped."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files: dict = {}

    def __call__(self, rank: int) -> dict:
        if rank not in self._files:
            self._files[rank] = read_rank_file(rank_file(self.directory, rank), mmap=True)
        return self._files[rank]


def _main_shard(saved: SavedRanks, key, shard: torch.Tensor, dp_rank: int, saved_size: int,
                saved_local: int) -> torch.Tensor:
    """This rank's 1/DP slice of a bucket's exact main weights, cut from the saved
    ranks' slices it overlaps (``shard`` holds the current weights, kept where the
    saved run had only padding)."""
    start, end = dp_rank * shard.numel(), (dp_rank + 1) * shard.numel()
    for k in range(start // saved_local, min(saved_size, -(-end // saved_local))):
        old = saved(k)["extra"]["sdp4bit"]["main_shards"][key]
        lo, hi = max(start, k * saved_local), min(end, (k + 1) * saved_local)
        shard[lo - start:hi - start] = old[lo - k * saved_local:hi - k * saved_local]
    return shard


def reshard_layer_state(saved: SavedRanks, base: dict, own: bool, optimizer, saved_size: int) -> dict:
    """The SDP4Bit layer's state for this rank under the current data-parallel size:
    the iteration; this rank's quantizer streams if the saved run had this rank (else
    none: new streams start from the seed); the exact fp32 main shards (1/DP of each
    fp32 bucket) cut from the saved ranks' shards."""
    main_shards = {}
    if base.get("main_shards"):
        for opt in adapter().sub_optimizers(optimizer):
            dp_rank, size = adapter().optimizer_group(opt)
            for key, bucket in adapter().buffer_buckets(opt):
                if key not in base["main_shards"]:
                    continue
                shard = adapter().param_shard(bucket, size, dp_rank).detach().float().clone().cpu()
                main_shards[key] = _main_shard(saved, key, shard, dp_rank, saved_size,
                                               base["main_shards"][key].numel())
    return {"iteration": base["iteration"], "rng": base["rng"] if own else {}, "main_shards": main_shards}


def load_resharded(directory: str, saved_layout: dict, model, optimizer, scheduler,
                   global_batch_size: Optional[int] = None) -> dict:
    """Load ``directory`` (saved with ``saved_layout``) into this run's data-parallel size."""
    rank, _ = rank_and_world()
    asked = group_settings(optimizer)
    saved_world, saved_size = saved_layout["world_size"], saved_layout["data_parallel_size"]
    saved = SavedRanks(directory)
    own = rank < saved_world
    state = dict(saved(rank if own else 0))
    load_model(model, saved(0)["model"], directory)
    saved_groups = align_saved_groups(adapter().sub_optimizers(optimizer), state["optimizer"])
    for i, opt in enumerate(adapter().sub_optimizers(optimizer)):
        opt.load_state_dict(state["optimizer"][i])
        param_state = adapter().reshard_parameter_state(opt, lambda k: saved(k)["param_state"][i], saved_size)
        if param_state is not None:
            adapter().load_parameter_state(opt, param_state)
        adapter().after_optimizer_load(opt)
    settle_schedule(state, directory, optimizer, scheduler, asked, saved_groups, global_batch_size)
    set_rng_state(state["rng"])
    extra = dict(state.get("extra") or {})
    if extra.get("sdp4bit"):
        extra["sdp4bit"] = reshard_layer_state(saved, extra["sdp4bit"], own, optimizer, saved_size)
    state["extra"] = extra
    return state
