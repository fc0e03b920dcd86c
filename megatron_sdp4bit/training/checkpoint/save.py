"""Atomic saves: every rank writes its file into ``iter_N.tmp``; the folder becomes
``iter_N`` only once every file is written and the manifest lists them, and the
tracker file is replaced last. A save stopped at any point leaves the previous
checkpoint as the latest, readable.

A save that fails (a full disk, a quota, a read-only or forbidden folder: any
error on any rank) fails on every rank alike, in one line that names the path,
the OS error and its errno (``ENOSPC``, ``EDQUOT``, ``EROFS``, ``EACCES``, ...);
its temporary folder is removed and the previous checkpoint stays the latest.
"""
from __future__ import annotations

import errno
import io
import os
import shutil
from typing import Callable, Optional

import torch

from megatron_sdp4bit.training.checkpoint.common import (
    LATEST, CheckpointError, adapter, all_gather, barrier, iter_dir, model_holder, pipeline_stage,
    rank_and_world, rank_file)
from megatron_sdp4bit.training.checkpoint.run_layout import current_layout, own_buckets
from megatron_sdp4bit.training.checkpoint.manifest import file_digest, write_manifest
from megatron_sdp4bit.training.checkpoint.rng_state import rng_state


def _probe_writable(save_dir: str) -> Optional[str]:
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        return f"--save {save_dir} is not writable ({exc.strerror}); choose a directory you can write"
    return None


def check_writable(save_dir: str) -> None:
    """Collective: fail before training, not at the first save, when SAVE cannot be
    written by some rank (on every rank alike)."""
    problem = next((p for p in all_gather(_probe_writable(save_dir)) if p), None)
    if problem:
        raise CheckpointError(problem)


def describe_os_error(exc: OSError, path: str) -> str:
    """``PATH: No space left on device (ENOSPC)``: the path, the OS's words, the errno's name."""
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else type(exc).__name__
    return f"{exc.filename or path}: {exc.strerror or exc} ({name})"


class _OsFile(io.RawIOBase):
    """A file torch.save writes through, which keeps the OS's error: torch's own
    writer turns it into ``unexpected pos 64 vs 0`` or ``basic_ios::clear``."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd
        self.error: Optional[OSError] = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = 0
            while written < len(view):
                written += os.write(self.fd, view[written:])
            return written
        except OSError as exc:
            self.error = exc
            raise


def write_rank_file(path: str, state: dict) -> None:
    """``state`` to ``path``, whole or not at all: written to ``.part``, synced to the
    disk, then renamed. An OS error is raised as the ``OSError`` it is."""
    part = path + ".part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        target = _OsFile(fd)
        try:
            torch.save(state, target)
        except RuntimeError:
            if target.error is not None:
                raise target.error from None
            raise
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, path)


def _param_names(model, optimizer) -> list:
    """Per sub-optimizer that is not distributed, the names of the params its state's
    indices stand for, per param group (None for a distributed one): what lets a run
    with the distributed optimizer take that state (``convert``)."""
    names = {id(param): name for name, param in model.named_parameters()}
    out = []
    for opt in adapter().sub_optimizers(optimizer):
        params = adapter().plain_model_params(opt)
        out.append(None if params is None else [[names[id(p)] for p in group] for group in params])
    return out


def _rank_state(iteration: int, model, optimizer, scheduler, extra: Optional[dict]) -> dict:
    sub_optimizers = adapter().sub_optimizers(optimizer)
    return {
        "iteration": iteration,
        "model": model.state_dict() if model_holder()[0] == 0 else None,
        "optimizer": [opt.state_dict() for opt in sub_optimizers],
        "param_state": [adapter().parameter_state_for_save(opt) for opt in sub_optimizers],
        "param_names": _param_names(model, optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }


def _fresh_folder(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
    os.makedirs(tmp)


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
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest + ".part", latest)


def _attempt(action: Callable[[], object], path: str) -> tuple:
    """(the action's result, None) or (None, what went wrong, in one line)."""
    try:
        return action(), None
    except OSError as exc:
        return None, describe_os_error(exc, path)
    except Exception as exc:  # every rank must reach the agreement that follows
        text = str(exc).strip().splitlines()
        return None, f"{path}: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class _Save:
    """One collective save: each step's outcome is agreed by every rank."""

    def __init__(self, save_dir: str, iteration: int):
        self.save_dir, self.iteration = save_dir, iteration
        self.rank = rank_and_world()[0]
        self.final = iter_dir(save_dir, iteration)
        self.tmp = self.final + ".tmp"

    def agree(self, result=None, problem: Optional[str] = None) -> list:
        """Every rank's result; a problem on any rank fails the save on every rank."""
        outcomes = all_gather((result, problem))
        failed = [(rank, p) for rank, (_, p) in enumerate(outcomes) if p]
        if failed:
            self.fail(*failed[0])
        return [r for r, _ in outcomes]

    def fail(self, rank: int, problem: str) -> None:
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
            tracker_part = os.path.join(self.save_dir, LATEST + ".part")
            if os.path.exists(tracker_part):
                os.remove(tracker_part)
        barrier()  # the temporary folder is gone before any rank reports
        previous = _tracker(self.save_dir)
        kept = (f"the last complete checkpoint, iteration {previous}, stays the latest" if previous is not None
                else f"there is no earlier checkpoint in {self.save_dir}")
        raise CheckpointError(
            f"saving the checkpoint of iteration {self.iteration} to {self.save_dir} failed on rank {rank}: "
            f"{problem}; its temporary folder was removed and {kept}. Free space or fix the folder, then "
            f"resume with --load {self.save_dir}")


def _tracker(save_dir: str) -> Optional[int]:
    try:
        text = open(os.path.join(save_dir, LATEST)).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def save_checkpoint(save_dir: str, iteration: int, model, optimizer, scheduler,
                    extra: Optional[dict] = None, data: Optional[dict] = None) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory.
    ``data`` (what decides the training samples, ``TrainingData.record``) is
    recorded in the manifest (see ``current_layout``); a failure raises
    ``CheckpointError`` on every rank (see the module docstring)."""
    save = _Save(save_dir, iteration)
    save.agree(*(_attempt(lambda: _fresh_folder(save.tmp), save.tmp) if save.rank == 0 else (None, None)))
    path = rank_file(save.tmp, save.rank)
    state = _rank_state(iteration, model, optimizer, scheduler, extra)

    def write_and_hash():
        write_rank_file(path, state)
        return (os.path.basename(path), *file_digest(path))

    entries = save.agree(*_attempt(write_and_hash, path + ".part"))
    stage_buckets = dict(all_gather((pipeline_stage(), own_buckets(optimizer))))
    outcome = (None, None)
    if save.rank == 0:
        layout = current_layout(model, optimizer, stage_buckets, data)
        outcome = _attempt(lambda: (write_manifest(save.tmp, iteration, layout, entries),
                                    _publish(save_dir, save.tmp, save.final, iteration)), save.tmp)
    save.agree(None, outcome[1])
    return save.final
