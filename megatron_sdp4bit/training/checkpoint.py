"""Checkpoints: every rank saves its own shard; writes are atomic.

Layout (Megatron-LM-like)::

    SAVE/latest_checkpointed_iteration.txt       the newest complete checkpoint
    SAVE/iter_0000020/rank_00000.pt              one torch.save file per rank

Each rank file holds the model's state dict (data-parallel rank 0 only: the
weights are identical on every rank), the distributed optimizer's non-parameter
state and this rank's parameter shards (fp32 main weights, Adam moments) in
megatron's "dp_reshardable" form, the learning-rate scheduler, the iteration
and data position, every RNG state (python, numpy, torch, megatron's tracker,
the SDP4Bit quantizers') and the patch layer's own state.

Atomicity: files are written to ``iter_X.tmp`` and renamed into place once every
rank has written; ``latest_checkpointed_iteration.txt`` is replaced (not edited)
last. A save killed at any point leaves the previous checkpoint readable.
"""
from __future__ import annotations

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch

LATEST = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    pass


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _sub_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


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


def save_checkpoint(save_dir: str, iteration: int, model, optimizer, scheduler,
                    extra: Optional[dict] = None) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    final = _iter_dir(save_dir, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
        os.makedirs(tmp)
    _barrier()
    state = {
        "iteration": iteration,
        "model": model.state_dict() if rank == 0 else None,
        "optimizer": [opt.state_dict() for opt in _sub_optimizers(optimizer)],
        "param_state": [_adapter().parameter_state_for_save(opt) for opt in _sub_optimizers(optimizer)],
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    path = _rank_file(tmp, rank)
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)
    _barrier()
    if rank == 0:
        if os.path.isdir(final):  # re-saving the same iteration: keep the old until the new is in
            shutil.move(final, final + ".old")
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        latest = os.path.join(save_dir, LATEST)
        with open(latest + ".part", "w") as f:
            f.write(f"{iteration}\n")
        os.replace(latest + ".part", latest)
    _barrier()
    return final


def latest_iteration(load_dir: str) -> Optional[int]:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def load_checkpoint(load_dir: str, model, optimizer, scheduler) -> Optional[dict]:
    """Restore everything saved by ``save_checkpoint``; None when LOAD has no checkpoint."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    directory = _iter_dir(load_dir, iteration)
    path = _rank_file(directory, rank)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing: the checkpoint was saved with a different number of ranks "
            "(this driver resumes with the same data-parallel size)"
        )
    state = torch.load(path, map_location="cpu", weights_only=False)
    model_state = state["model"]
    if model_state is None:
        model_state = torch.load(_rank_file(directory, 0), map_location="cpu", weights_only=False)["model"]
    model.load_state_dict(model_state)
    for opt, opt_state, param_state in zip(_sub_optimizers(optimizer), state["optimizer"], state["param_state"]):
        opt.load_state_dict(opt_state)
        if param_state is not None:
            opt.load_parameter_state_from_dp_reshardable(param_state)
        _adapter().after_optimizer_load(opt)
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state
