"""Loading a checkpoint saved with another data-parallel size.

The model comes from rank 0's file; the optimizer shards are cut from the saved
ranks' files that overlap this rank's (``reshard_parameter_state``: megatron's own
dp_reshardable arithmetic, on the form the adapter saves and loads); the layer's
exact fp32 main shards (fp32 params under qWD) likewise. The rest (scheduler, RNG
states, the optimizer's step and hyper-parameters) is the same on every saved
rank and is read from this rank's file, or rank 0's for a rank the saved run did
not have. The SDP4Bit quantizer streams are per rank: a rank the saved run had
continues its own, a new rank starts its streams from the seed.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_sdp4bit.megatron.main_shards import Key, chain_buckets, fp32_buckets, under_current_keys
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


def reshard_parameter_state(own: dict, dp_rank: int, dp_size: int, saved_rank_state,
                            saved_size: int) -> dict:
    """This rank's optimizer shards for ``dp_size`` ranks, in megatron's "dp_reshardable"
    form (``adapter.parameter_state_for_save``: ``own`` is this rank's, whose entries
    name the ranges to fill), cut from the states of another run's ``saved_size`` ranks
    with the same ``bucket_layout``. ``saved_rank_state(k)`` returns data-parallel rank
    k's saved state; only the ranks whose shards overlap this rank's are asked.

    megatron-core reshards this form only inside dist_checkpointing
    (``sharded_param_state_dp_reshardable``): every bucket is one tensor of its unpadded
    size, of which DP rank r's entry covers ``[r * n/DP + gbuf_local_start, r * n/DP +
    gbuf_local_end)``, n being the bucket's padded size. Its plain loader
    (``adapter.load_parameter_state``) zips the saved entries with this rank's params and
    asserts their counts match (the ``AssertionError: (22, 42)`` of a 4-rank checkpoint
    on 2 ranks). Here the same arithmetic runs over the saved per-rank states: each of
    this rank's entries is cut from the saved entries it overlaps."""
    first = saved_rank_state(0)
    if first["per_bucket_numel_unpadded"] != own["per_bucket_numel_unpadded"]:
        raise ValueError(
            f"the saved buckets hold {first['per_bucket_numel_unpadded']} elements, this "
            f"run's {own['per_bucket_numel_unpadded']}: the optimizer state cannot be resharded")
    result = {"per_bucket_numel": own["per_bucket_numel"],
              "per_bucket_numel_unpadded": own["per_bucket_numel_unpadded"]}
    for gbuf_idx, per_dtype in own.items():
        if not isinstance(gbuf_idx, int):
            continue
        result[gbuf_idx] = {}
        for dtype, buckets in per_dtype.items():
            result[gbuf_idx][dtype] = []
            for bucket_idx, entries in enumerate(buckets):
                local = own["per_bucket_numel"][gbuf_idx][dtype][bucket_idx] // dp_size
                saved_local = first["per_bucket_numel"][gbuf_idx][dtype][bucket_idx] // saved_size
                result[gbuf_idx][dtype].append([
                    _cut_entry(entry, dp_rank * local, saved_local, saved_size,
                               lambda k: saved_rank_state(k)[gbuf_idx][dtype][bucket_idx])
                    for entry in entries if not entry.get("padding", False)])
    return result


def _cut_entry(entry: dict, shard_start: int, saved_local: int, saved_size: int, saved_bucket) -> dict:
    """One of this rank's entries, its tensors filled from the saved entries that
    overlap its range of the bucket ``[start, end)``."""
    start = shard_start + entry["gbuf_local_start"]
    end = shard_start + entry["gbuf_local_end"]
    out, covered = {}, 0
    for k in range(start // saved_local, min(saved_size, -(-end // saved_local))):
        for saved in saved_bucket(k):
            if saved.get("padding", False):
                continue
            saved_start = k * saved_local + saved["gbuf_local_start"]
            lo = max(start, saved_start)
            hi = min(end, k * saved_local + saved["gbuf_local_end"])
            if lo >= hi:
                continue
            for key, value in saved.items():
                if not torch.is_tensor(value):
                    continue
                if value.dim() == 0:  # Adam's step: the same in every entry
                    out.setdefault(key, value.clone())
                    continue
                if key not in out:
                    out[key] = torch.empty(end - start, dtype=value.dtype)
                out[key][lo - start:hi - start] = value[lo - saved_start:hi - saved_start]
            covered += hi - lo
    if covered != end - start:
        raise ValueError(f"the saved shards cover {covered} of elements {start}..{end} "
                         "of a bucket: the checkpoint does not match this model")
    out.update(gbuf_local_start=entry["gbuf_local_start"], gbuf_local_end=entry["gbuf_local_end"],
               padding=False)
    return out


def _main_shard(saved: SavedRanks, key: Key, buckets: Dict[Key, Tuple[int, int]], shard: torch.Tensor,
                dp_rank: int, saved_size: int, saved_local: int) -> torch.Tensor:
    """This rank's 1/DP slice of a bucket's exact main weights, cut from the saved
    ranks' slices it overlaps (``shard`` holds the current weights, kept where the
    saved run had only padding). ``buckets``: this run's fp32 buckets, which read a
    file an older release keyed otherwise (``main_shards.under_current_keys``)."""
    start, end = dp_rank * shard.numel(), (dp_rank + 1) * shard.numel()
    for k in range(start // saved_local, min(saved_size, -(-end // saved_local))):
        old, _ = under_current_keys(saved(k)["extra"]["sdp4bit"]["main_shards"], buckets)
        lo, hi = max(start, k * saved_local), min(end, (k + 1) * saved_local)
        shard[lo - start:hi - start] = old[key][lo - k * saved_local:hi - k * saved_local]
    return shard


def reshard_layer_state(saved: SavedRanks, base: dict, own: bool, optimizer, saved_size: int) -> dict:
    """The SDP4Bit layer's state for this rank under the current data-parallel size:
    the iteration; this rank's quantizer streams if the saved run had this rank (else
    none: new streams start from the seed); the exact fp32 main shards (1/DP of each
    fp32 bucket) cut from the saved ranks' shards."""
    main_shards = {}
    if base.get("main_shards"):
        buckets = fp32_buckets(adapter(), optimizer)
        first, _ = under_current_keys(base["main_shards"], buckets)
        for key, opt, bucket in chain_buckets(adapter(), optimizer):
            if key not in first:
                continue
            dp_rank, size = adapter().optimizer_group(opt)
            shard = adapter().param_shard(bucket, size, dp_rank).detach().float().clone().cpu()
            main_shards[key] = _main_shard(saved, key, buckets, shard, dp_rank, saved_size, first[key].numel())
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
        own_state = adapter().parameter_state_for_save(opt)  # None: not a distributed optimizer
        if own_state is not None:
            dp_rank, dp_size = adapter().optimizer_group(opt)
            adapter().load_parameter_state(opt, reshard_parameter_state(
                own_state, dp_rank, dp_size, lambda k: saved(k)["param_state"][i], saved_size))
        adapter().after_optimizer_load(opt)
    settle_schedule(state, directory, optimizer, scheduler, asked, saved_groups, global_batch_size)
    set_rng_state(state["rng"])
    extra = dict(state.get("extra") or {})
    if extra.get("sdp4bit"):
        extra["sdp4bit"] = reshard_layer_state(saved, extra["sdp4bit"], own, optimizer, saved_size)
    state["extra"] = extra
    return state
