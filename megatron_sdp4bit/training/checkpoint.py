"""Checkpoints: every rank saves its own shard; writes are atomic and verified.

Layout (Megatron-LM-like)::

    SAVE/latest_checkpointed_iteration.txt       the newest complete checkpoint
    SAVE/iter_0000020/rank_00000.pt              one torch.save file per rank
    SAVE/iter_0000020/manifest.json              written last: layout, files, sizes, SHA-256

Each rank file holds the model's state dict (data-parallel rank 0 only: the
weights are identical across data-parallel ranks), the distributed optimizer's non-parameter state and
this rank's parameter shards (fp32 main weights, Adam moments) in megatron's
"dp_reshardable" form, the learning-rate scheduler, the iteration (the data
position follows from it), every RNG state (python, numpy, torch, megatron's
tracker, the SDP4Bit quantizers') and the patch layer's own state.

The manifest records the run's layout (world, data-, tensor- and
pipeline-parallel sizes, megatron-core version, SDP4Bit config, the optimizer's
bucket layout) and every file's size and SHA-256 (each rank hashes its own).

Atomicity: files are written to ``iter_X.tmp``; once every rank has written and
hashed its file, rank 0 writes the manifest (``.part``, then renamed) and renames
the directory into place; ``latest_checkpointed_iteration.txt`` is replaced (not
edited) last. A save killed at any point leaves the previous checkpoint readable.

Loading (``load_checkpoint``), in three steps, the first two collective and
decided alike on every rank, so no rank starts (or says it resumed) when another
cannot:

1. verify: the ranks split the manifest's files, check size and SHA-256, and
   share what they found. A damaged latest checkpoint is an error naming the bad
   file and the newest earlier checkpoint that verifies; with ``fallback=True``
   (``--load-fallback``) that one is loaded instead, and the log says so.
2. compare layouts: a different data-parallel size is resharded (below); a
   different tensor- or pipeline-parallel size, parameter dtype or bucket layout
   is refused in one line; a different megatron-core version or SDP4Bit config
   is loaded with a one-line warning.
3. load, with the outcome agreed between the ranks.

Resharding to another data-parallel size: the model comes from rank 0's file;
the optimizer shards are cut from the saved ranks' files that overlap this rank's
(``adapter.reshard_parameter_state``: megatron's own dp_reshardable arithmetic,
then megatron's loader); the layer's exact fp32 main shards (fp32 params under
qWD) likewise. The rest (scheduler, RNG states, the optimizer's step and
hyper-parameters) is the same on every saved rank and is read from this rank's
file, or rank 0's for a rank the saved run did not have. The SDP4Bit quantizer
streams are per rank: a rank the saved run had continues its own, a new rank
starts its streams from the seed.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    pass


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def _rank_and_world() -> Tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _model_holder() -> Tuple[int, int]:
    """(this rank's data-parallel rank, the global rank of data-parallel rank 0 of its
    group): that rank's file holds the model weights of this rank's model shard."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            ranks = torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group())
            return parallel_state.get_data_parallel_rank(), ranks[0]
    except ImportError:  # pragma: no cover - megatron is a dependency
        pass
    return _rank_and_world()[0], 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _all_gather(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    rank, world = _rank_and_world()
    if world == 1:
        return [obj]
    out = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def _log0(message: str) -> None:
    if _rank_and_world()[0] == 0:
        print(message, flush=True)


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


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _adapter():
    """megatron-core's checkpoint quirks are version-specific: the patch layer's
    adapter for the installed release knows them."""
    from megatron_sdp4bit.megatron.adapters import current_adapter

    return current_adapter()


# --- layout -----------------------------------------------------------------------------

def _pipeline_stage() -> str:
    """This rank's pipeline stage, as a JSON key: stages hold different layers, so
    their optimizer buckets differ (TP and DP ranks of a stage share a layout)."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return str(parallel_state.get_pipeline_model_parallel_rank())
    except ImportError:  # pragma: no cover - megatron is a dependency
        pass
    return "0"


def _own_buckets(optimizer) -> list:
    return [_adapter().bucket_layout(opt) for opt in _adapter().sub_optimizers(optimizer)]


def current_layout(model, optimizer, stage_buckets: Optional[dict] = None,
                   global_batch_size: Optional[int] = None) -> dict:
    """What a checkpoint of this run records about how it was run (JSON-ready).

    ``buckets`` maps each pipeline stage to its optimizer buckets: all stages'
    (``stage_buckets``, gathered by the saving ranks), else only this rank's.
    ``global_batch_size``: the training loop's, when it has one (the learning-rate
    schedule and the data position count samples of that size).
    """
    from megatron_sdp4bit.megatron import adapters, patch

    _, world = _rank_and_world()
    sizes = {"data_parallel_size": world, "tensor_model_parallel_size": 1,
             "pipeline_model_parallel_size": 1}
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            sizes = {"data_parallel_size": parallel_state.get_data_parallel_world_size(),
                     "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
                     "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size()}
    except ImportError:  # pragma: no cover - megatron is a dependency
        pass
    config = patch.current_config()
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]  # virtual stages
    ddp_config = getattr(chunks[0], "ddp_config", None) if chunks else None
    return {
        "world_size": world, **sizes,
        "megatron_core": adapters.megatron_version(),
        "sdp4bit": config.to_dict() if config is not None else None,
        "buckets": stage_buckets if stage_buckets is not None else {_pipeline_stage(): _own_buckets(optimizer)},
        "bucket_size": getattr(ddp_config, "bucket_size", None),
        "global_batch_size": global_batch_size,
    }


def _preset_name(config: Optional[dict]) -> str:
    from megatron_sdp4bit.config import PRESETS

    if config is None:
        return "no SDP4Bit layer"
    ignored = ("ranks_per_node", "seed")
    for name, candidate in PRESETS.items():
        known = candidate.to_dict()
        if all(config.get(k) == v for k, v in known.items() if k not in ignored):
            return f"preset {name}"
    return "a custom SDP4Bit config"


def _release(version: str) -> str:
    """``0.19.2`` of ``0.19.2+3b25f53``: megatron-core 0.19 appends the git commit of the
    directory it is imported from, which says nothing about the checkpoint."""
    return version.split("+", 1)[0]


def compare_layouts(directory: str, saved: dict, current: dict) -> Tuple[bool, List[str]]:
    """(reshard, warnings): whether the data-parallel size differs (then the state is
    resharded) and one line per harmless difference. A difference that cannot be
    loaded raises ``CheckpointError``, in one line saying what differs."""
    where = f"checkpoint {directory} was saved with"
    for key, what, flag in (("tensor_model_parallel_size", "tensor-parallel", "--tensor-model-parallel-size"),
                            ("pipeline_model_parallel_size", "pipeline-parallel",
                             "--pipeline-model-parallel-size")):
        if saved.get(key) is not None and saved[key] != current[key]:
            raise CheckpointError(
                f"{where} {what} size {saved[key]}, this run has {current[key]}; checkpoints are "
                f"resharded across data-parallel sizes only: resume with {flag} {saved[key]}")
    stage, = current["buckets"]  # this rank's stage
    saved_buckets, buckets = saved.get("buckets"), current["buckets"][stage]
    if isinstance(saved_buckets, dict):
        saved_buckets = saved_buckets.get(stage)
    if saved_buckets is not None and buckets is not None and saved_buckets != buckets:
        saved_dtypes = [b["dtypes"] for opt in saved_buckets if opt for b in opt]
        dtypes = [b["dtypes"] for opt in buckets if opt for b in opt]
        if saved_dtypes != dtypes or [o is None for o in saved_buckets] != [o is None for o in buckets]:
            raise CheckpointError(
                f"{where} parameter/gradient dtypes {saved_dtypes}, this run has {dtypes} "
                f"(--bf16 and the distributed optimizer must be as when it was saved)")
        hint, size = "", saved.get("bucket_size")
        if size != current.get("bucket_size"):
            hint = (f" (its DDP bucket size was {size}: pass --bucket-size {size})" if size else
                    " (it had one bucket per buffer: resume without --overlap-grad-reduce)")
        raise CheckpointError(
            f"{where} optimizer buckets of {[b['numel_unpadded'] for opt in saved_buckets if opt for b in opt]} "
            f"elements, this run's are {[b['numel_unpadded'] for opt in buckets if opt for b in opt]}: "
            f"the model's shape or the bucketing differ{hint}")
    batch = saved.get("global_batch_size")
    if batch is not None and current.get("global_batch_size") is not None and batch != current["global_batch_size"]:
        # Its default is micro-batch x data-parallel size, so it changes silently with
        # the number of ranks; the schedule and the data position count its samples.
        raise CheckpointError(
            f"{where} global batch size {batch}, this run has {current['global_batch_size']} (without "
            f"--global-batch-size it is --micro-batch-size x data-parallel size): resume with "
            f"--global-batch-size {batch}")
    reshard = saved["data_parallel_size"] != current["data_parallel_size"]
    if reshard and (current["tensor_model_parallel_size"] != 1 or current["pipeline_model_parallel_size"] != 1):
        raise CheckpointError(
            f"{where} data-parallel size {saved['data_parallel_size']}, this run has "
            f"{current['data_parallel_size']}; resharding is supported with TP = PP = 1 only: "
            f"resume with {saved['data_parallel_size']} data-parallel ranks")
    warnings = []
    if saved.get("megatron_core") and _release(saved["megatron_core"]) != _release(current["megatron_core"]):
        warnings.append(f"warning: {where} megatron-core {saved['megatron_core']}, this run has "
                        f"{current['megatron_core']}; loading it (the checkpoint's contents are the same "
                        "in the supported releases)")
    ignored = ("ranks_per_node",)
    old, new = saved.get("sdp4bit"), current.get("sdp4bit")
    if old is not None and new is not None:
        changed = [f"{k} {old.get(k)} -> {new.get(k)}" for k in new
                   if k not in ignored and old.get(k) != new.get(k)]
        if changed:
            warnings.append(f"warning: {where} SDP4Bit {_preset_name(old)}, this run uses "
                            f"{_preset_name(new)} ({', '.join(changed)}); training continues with this "
                            "run's config")
    return reshard, warnings


# --- integrity --------------------------------------------------------------------------

def file_digest(path: str, chunk: int = 1 << 23) -> Tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            size += len(block)
            digest.update(block)
    return size, digest.hexdigest()


def read_manifest(directory: str) -> Optional[dict]:
    """The checkpoint's manifest; None when it has none (saved before manifests
    existed); ``CheckpointError`` when it is there but unreadable."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("layout"), dict):
            raise ValueError("no 'files' or 'layout'")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{MANIFEST} is unreadable ({exc})") from exc
    return manifest


def check_files(directory: str, manifest: dict, share: int = 0, shares: int = 1) -> List[str]:
    """What is wrong with the files of ``manifest`` (every ``shares``-th from ``share``),
    one line each; empty when they are as saved."""
    problems = []
    for name in sorted(manifest["files"])[share::shares]:
        expected = manifest["files"][name]
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
            continue
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            kind = "truncated" if size < expected["bytes"] else "too long"
            problems.append(f"{name} is {size} bytes, the manifest says {expected['bytes']} ({kind})")
            continue
        if file_digest(path)[1] != expected["sha256"]:
            problems.append(f"{name} has SHA-256 {file_digest(path)[1][:12]}..., the manifest says "
                            f"{expected['sha256'][:12]}... (its contents changed)")
    return problems


def _verify(directory: str) -> Tuple[Optional[dict], Optional[str]]:
    """Collective: (manifest, None) for a checkpoint whose files are as saved,
    (None, None) for one without a manifest (an older save: unverified),
    (None, what is wrong) otherwise. The same answer on every rank."""
    rank, world = _rank_and_world()
    manifest, problems = None, []
    if not os.path.isdir(directory):
        problems = [f"{os.path.basename(directory)} is missing"]
    else:
        try:
            manifest = read_manifest(directory)
        except CheckpointError as exc:
            problems = [str(exc)]
        if manifest is not None:
            try:
                problems = check_files(directory, manifest, rank, world)
            except Exception as exc:  # every rank must reach the gather below
                problems = [f"cannot check it ({type(exc).__name__}: {exc})"]
        elif not problems and not os.path.isfile(_rank_file(directory, 0)):
            problems = [f"it has neither {MANIFEST} nor rank_00000.pt"]
    everyone = sorted({p for found in _all_gather(problems) for p in found})
    if everyone:
        shown = everyone[:3] + ([f"and {len(everyone) - 3} more"] if len(everyone) > 3 else [])
        return None, "; ".join(shown)
    return manifest, None


def _checkpoint_iterations(load_dir: str) -> List[int]:
    found = []
    for name in os.listdir(load_dir):
        match = _ITER_DIR.match(name)
        if match and os.path.isdir(os.path.join(load_dir, name)):
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def _choose_checkpoint(load_dir: str, fallback: bool) -> Tuple[str, Optional[dict]]:
    """Collective: the directory to load and its manifest (see the module docstring)."""
    path = os.path.join(load_dir, LATEST)
    text = open(path).read().strip()
    if text.isdigit():
        wanted = int(text)
        directory = _iter_dir(load_dir, wanted)
        manifest, problem = _verify(directory)
        if problem is None:
            if manifest is None:
                _log0(f"warning: {directory} has no {MANIFEST} (saved by an older version): its files "
                      "are not verified and its layout is taken from its rank files")
            return directory, manifest
        damaged = f"checkpoint {directory} is damaged: {problem}"
    else:
        wanted = None
        damaged = f"{path} holds {text!r}, not an iteration number"
    previous = None
    for iteration in _checkpoint_iterations(load_dir):
        if wanted is not None and iteration >= wanted:
            continue
        candidate = _iter_dir(load_dir, iteration)
        manifest, problem = _verify(candidate)
        if problem is None and manifest is not None:
            previous = (candidate, manifest)
            break
    if previous is None:
        raise CheckpointError(f"{damaged}. There is no earlier complete checkpoint in {load_dir}")
    if not fallback:
        raise CheckpointError(
            f"{damaged}. The previous complete checkpoint is {previous[0]} (iteration "
            f"{previous[1]['iteration']}): rerun with --load-fallback to resume from it")
    _log0(f"--load-fallback: {damaged}; loading the previous complete checkpoint, {previous[0]} "
          f"(iteration {previous[1]['iteration']})")
    return previous


# --- save -------------------------------------------------------------------------------

def _write_manifest(directory: str, iteration: int, layout: dict, entries: list) -> None:
    manifest = {"format": MANIFEST_FORMAT, "iteration": iteration, "layout": layout,
                "files": {name: {"bytes": size, "sha256": sha} for name, size, sha in entries}}
    path = os.path.join(directory, MANIFEST)
    with open(path + ".part", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def save_checkpoint(save_dir: str, iteration: int, model, optimizer, scheduler,
                    extra: Optional[dict] = None, global_batch_size: Optional[int] = None) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory.
    ``global_batch_size`` is recorded in the manifest (see ``current_layout``)."""
    rank, _ = _rank_and_world()
    final = _iter_dir(save_dir, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
        os.makedirs(tmp)
    _barrier()
    sub_optimizers = _adapter().sub_optimizers(optimizer)
    state = {
        "iteration": iteration,
        "model": model.state_dict() if _model_holder()[0] == 0 else None,
        "optimizer": [opt.state_dict() for opt in sub_optimizers],
        "param_state": [_adapter().parameter_state_for_save(opt) for opt in sub_optimizers],
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    path = _rank_file(tmp, rank)
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)
    entries = _all_gather((os.path.basename(path), *file_digest(path)))  # also: all have written
    stage_buckets = dict(_all_gather((_pipeline_stage(), _own_buckets(optimizer))))
    if rank == 0:
        _write_manifest(tmp, iteration, current_layout(model, optimizer, stage_buckets, global_batch_size),
                        entries)
        if os.path.isdir(final):  # re-saving the same iteration: keep the old until the new is in
            shutil.rmtree(final + ".old", ignore_errors=True)
            shutil.move(final, final + ".old")
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        latest = os.path.join(save_dir, LATEST)
        with open(latest + ".part", "w") as f:
            f.write(f"{iteration}\n")
        os.replace(latest + ".part", latest)
    _barrier()
    return final


# --- load -------------------------------------------------------------------------------

def latest_iteration(load_dir: str) -> Optional[int]:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def _read(path: str, mmap: bool = False) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing") from exc
    except Exception as exc:  # a damaged file: torch's zip reader or unpickler
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is unreadable, the checkpoint is damaged ({first})") from exc


def _legacy_layout(directory: str) -> dict:
    ranks = [n for n in os.listdir(directory) if re.match(r"^rank_\d{5}\.pt$", n)]
    return {"world_size": len(ranks), "data_parallel_size": len(ranks),
            "tensor_model_parallel_size": None, "pipeline_model_parallel_size": None}


def _load_same_layout(directory: str, model, optimizer, scheduler) -> dict:
    rank, _ = _rank_and_world()
    state = _read(_rank_file(directory, rank))
    model_state = state["model"]
    if model_state is None:
        model_state = _read(_rank_file(directory, _model_holder()[1]), mmap=True)["model"]
    model.load_state_dict(model_state)
    for opt, opt_state, param_state in zip(_adapter().sub_optimizers(optimizer), state["optimizer"],
                                           state["param_state"]):
        opt.load_state_dict(opt_state)
        if param_state is not None:
            _adapter().load_parameter_state(opt, param_state)
        _adapter().after_optimizer_load(opt)
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state


class _SavedRanks:
    """The saved run's rank files, each read once, on demand, memory-mapped."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files: dict = {}

    def __call__(self, rank: int) -> dict:
        if rank not in self._files:
            self._files[rank] = _read(_rank_file(self.directory, rank), mmap=True)
        return self._files[rank]


def _reshard_layer_state(saved: _SavedRanks, base: dict, own: bool, optimizer, saved_size: int) -> dict:
    """The SDP4Bit layer's state for this rank under the current data-parallel size:
    the iteration; this rank's quantizer streams if the saved run had this rank (else
    none: new streams start from the seed); the exact fp32 main shards (1/DP of each
    fp32 bucket) cut from the saved ranks' shards, the current weights where the
    saved run had only padding."""
    adapter = _adapter()
    main_shards = {}
    if base.get("main_shards"):
        for opt in adapter.sub_optimizers(optimizer):
            dp_rank, size = adapter.optimizer_group(opt)
            for key, bucket in adapter.buffer_buckets(opt):
                if key not in base["main_shards"]:
                    continue
                saved_local = base["main_shards"][key].numel()
                shard = adapter.param_shard(bucket, size, dp_rank).detach().float().clone().cpu()
                start, end = dp_rank * shard.numel(), (dp_rank + 1) * shard.numel()
                for k in range(start // saved_local, min(saved_size, -(-end // saved_local))):
                    old = saved(k)["extra"]["sdp4bit"]["main_shards"][key]
                    lo, hi = max(start, k * saved_local), min(end, (k + 1) * saved_local)
                    shard[lo - start:hi - start] = old[lo - k * saved_local:hi - k * saved_local]
                main_shards[key] = shard
    return {"iteration": base["iteration"], "rng": base["rng"] if own else {}, "main_shards": main_shards}


def _load_resharded(directory: str, saved_layout: dict, model, optimizer, scheduler) -> dict:
    rank, _ = _rank_and_world()
    saved_world, saved_size = saved_layout["world_size"], saved_layout["data_parallel_size"]
    saved = _SavedRanks(directory)
    own = rank < saved_world
    state = dict(saved(rank if own else 0))
    model.load_state_dict(saved(0)["model"])
    adapter = _adapter()
    for i, opt in enumerate(_adapter().sub_optimizers(optimizer)):
        opt.load_state_dict(state["optimizer"][i])
        param_state = adapter.reshard_parameter_state(opt, lambda k: saved(k)["param_state"][i], saved_size)
        if param_state is not None:
            adapter.load_parameter_state(opt, param_state)
        adapter.after_optimizer_load(opt)
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    extra = dict(state.get("extra") or {})
    if extra.get("sdp4bit"):
        extra["sdp4bit"] = _reshard_layer_state(saved, extra["sdp4bit"], own, optimizer, saved_size)
    state["extra"] = extra
    return state


def load_checkpoint(load_dir: str, model, optimizer, scheduler, fallback: bool = False,
                    global_batch_size: Optional[int] = None) -> Optional[dict]:
    """Restore everything saved by ``save_checkpoint``; None when LOAD has no checkpoint.

    Collective. Verifies the checkpoint and compares its layout with this run's
    before anything is loaded, and raises ``CheckpointError`` on every rank alike
    when any rank cannot load (see the module docstring). ``fallback``: load the
    newest earlier complete checkpoint when the latest is damaged; ``global_batch_size``:
    this run's, refused when it differs from the recorded one. The returned
    state carries ``directory`` (the checkpoint loaded); its ``extra["sdp4bit"]``
    is the layer's state for this rank, resharded when the data-parallel size
    changed.
    """
    if not os.path.isfile(os.path.join(load_dir, LATEST)):
        return None
    directory, manifest = _choose_checkpoint(load_dir, fallback)
    saved_layout = manifest["layout"] if manifest is not None else _legacy_layout(directory)
    layout = current_layout(model, optimizer, global_batch_size=global_batch_size)
    try:
        reshard, warnings = compare_layouts(directory, saved_layout, layout)
        refusal = None
    except CheckpointError as exc:  # a stage may differ alone: every rank refuses alike
        refusal = str(exc)
    refusals = [r for r in _all_gather(refusal) if r]
    if refusals:
        raise CheckpointError(refusals[0])
    for line in warnings:
        _log0(line)
    if reshard:
        _log0(f"{directory} was saved with data-parallel size {saved_layout['data_parallel_size']}, "
              f"this run has {layout['data_parallel_size']}: resharding the optimizer state")
    rank, _ = _rank_and_world()
    error, failure = None, None
    try:
        with torch.no_grad():  # fp32 params: megatron's main params are views of them
            state = (_load_resharded(directory, saved_layout, model, optimizer, scheduler) if reshard
                     else _load_same_layout(directory, model, optimizer, scheduler))
    except Exception as exc:  # agreed below, so that no rank goes on alone
        error, state = exc, None
        failure = f"rank {rank}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
    failures = [f for f in _all_gather(failure) if f]
    if error is not None:
        raise error
    if failures:
        raise CheckpointError(f"loading {directory} failed on {failures[0]}")
    state["directory"] = directory
    return state
