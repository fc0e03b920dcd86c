"""What ``--load`` and ``--save`` name, and the one checkpoint a resume starts from.

``plan_resume`` turns ``--load`` into a ``ResumePlan`` before anything is built:

- a folder ``--save`` wrote: its tracker file names the latest checkpoint; without
  one (lost, or a copy of the ``iter_*`` folders only) the newest complete
  checkpoint is taken, and the log says so;
- one checkpoint of such a folder (``--load ck/iter_0000010``): that checkpoint;
- nothing there: an error, except when ``--load`` is ``--save``'s folder and it
  holds no checkpoint yet (``--save ck --load ck``, the command that starts a job
  and resumes it after every interruption): then the run starts from scratch.

``check_save_folder`` then refuses a ``--save`` folder whose checkpoints this run
would replace: another run's (it does not resume from them) or newer ones than
the checkpoint it resumes from; and a ``--save`` that is one checkpoint itself.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron_sdp4bit.training.checkpoint.common import (
    ITER_DIR, LATEST, MANIFEST, RANK_FILE, CheckpointError, all_gather, rank_and_world)
from megatron_sdp4bit.training.checkpoint.manifest import checkpoint_iterations, choose_checkpoint
from megatron_sdp4bit.training.console import log0


@dataclass(frozen=True)
class ResumePlan:
    """Where a run starts: from scratch (``directory`` None) or from one checkpoint."""

    folder: Optional[str] = None
    """The folder of checkpoints ``--load`` named (a ``--save`` folder)."""
    directory: Optional[str] = None
    """The checkpoint to load, verified."""
    manifest: Optional[dict] = None
    iteration: int = 0
    """The iteration training starts from."""
    damaged: Tuple[int, ...] = ()
    """Checkpoints of ``folder`` found damaged and passed over (``--load-fallback``)."""


def same_folder(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def saved_iterations(folder: str) -> list:
    """Every iteration ``folder`` holds a checkpoint of, or names in its tracker file."""
    if not os.path.isdir(folder):
        return []
    found = set(checkpoint_iterations(folder))
    tracker = os.path.join(folder, LATEST)
    if os.path.isfile(tracker):
        text = open(tracker).read().strip()
        if text.isdigit():
            found.add(int(text))
    return sorted(found)


def _holds_checkpoints(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, LATEST)) or bool(checkpoint_iterations(folder))


def _load_target(path: str) -> Tuple[str, Optional[int]]:
    """(the folder of checkpoints, the pinned iteration or None) that ``--load path`` names."""
    if os.path.isfile(path):
        raise CheckpointError(f"--load {path} is a file: pass the folder --save wrote (the one holding "
                              f"{LATEST} and iter_* folders)")
    name = os.path.basename(os.path.normpath(path))
    if name.startswith("iter_") and name.endswith(".tmp"):
        raise CheckpointError(f"--load {path} is a save that never finished (a .tmp folder); pass its "
                              f"folder, --load {os.path.dirname(os.path.normpath(path))}")
    match = ITER_DIR.match(name)
    if match and os.path.isdir(path):
        return os.path.dirname(os.path.normpath(path)) or ".", int(match.group(1))
    return path, None


def _target_here(load: str, save: Optional[str]) -> Optional[Tuple[str, Optional[int]]]:
    """(folder, pinned iteration or None) to resume from; None: start from scratch."""
    folder, pinned = _load_target(load)
    if pinned is None and not (os.path.isdir(folder) and _holds_checkpoints(folder)):
        if same_folder(folder, save):
            return None
        where = "does not exist" if not os.path.exists(folder) else (
            f"holds no checkpoint (no {LATEST}, no iter_* folder)")
        raise CheckpointError(f"--load {load} {where}: pass the folder --save wrote, or drop --load to "
                              "start from scratch")
    return folder, pinned


def plan_resume(load: Optional[str], save: Optional[str], fallback: bool) -> ResumePlan:
    """Collective: where this run starts, the same answer on every rank (see the module
    docstring); ``CheckpointError`` when ``--load`` names nothing this run can resume.
    ``fallback``: ``--load-fallback`` (a damaged checkpoint gives way to the newest
    earlier complete one)."""
    if not load:
        return ResumePlan()
    try:
        target, refusal = _target_here(load, save), None
    except CheckpointError as exc:
        target, refusal = None, str(exc)
    refusals = [r for r in all_gather(refusal) if r]
    if refusals:
        raise CheckpointError(refusals[0])
    if target is None:
        log0(f"--load {load}: no checkpoint there yet, starting from scratch (it is also --save)")
        return ResumePlan()
    folder, pinned = target
    if pinned is None and not os.path.isfile(os.path.join(folder, LATEST)):
        log0(f"--load {load}: no {LATEST} there; resuming from its newest complete checkpoint")
    directory, manifest, damaged = choose_checkpoint(folder, fallback, iteration=pinned)
    return ResumePlan(folder=folder, directory=directory, manifest=manifest,
                      iteration=_iteration_of(directory, manifest), damaged=tuple(damaged))


def _iteration_of(directory: str, manifest: Optional[dict]) -> int:
    if manifest is not None:
        return int(manifest["iteration"])
    return int(ITER_DIR.match(os.path.basename(directory)).group(1))


def _save_refusal(save: str, plan: ResumePlan) -> Optional[str]:
    """Why saving into ``save`` would replace checkpoints this run does not continue, or
    put them where a ``--load`` of the folder meant would not find them."""
    if os.path.isdir(save) and (os.path.isfile(os.path.join(save, MANIFEST))
                                or any(RANK_FILE.match(name) for name in os.listdir(save))):
        return (f"--save {save} is one checkpoint (it holds {MANIFEST} or rank files), not a folder of them: "
                f"pass its folder, --save {os.path.dirname(os.path.normpath(save)) or '.'}")
    if same_folder(save, plan.folder):
        newer = [i for i in saved_iterations(save) if i > plan.iteration and i not in plan.damaged]
        if not newer:
            return None
        return (f"--save {save} holds checkpoints newer than the one this run resumes from (iteration "
                f"{plan.iteration}): iteration(s) {newer}; saving there would replace them. Resume from "
                f"the newest with --load {os.path.join(save, f'iter_{newer[-1]:07d}')}, or choose another --save")
    found = saved_iterations(save)
    if not found:
        return None
    start = (f"from {plan.folder} at iteration {plan.iteration}" if plan.directory else "from scratch")
    return (f"--save {save} already holds checkpoints (up to iteration {found[-1]}) and this run starts "
            f"{start}: saving there would replace them. Resume them with --load {save}, or choose an empty "
            "--save folder")


def check_save_folder(save: Optional[str], plan: ResumePlan) -> None:
    """Collective: refuse (on every rank alike) a ``--save`` whose checkpoints this run
    would replace (see the module docstring); rank 0 decides."""
    if not save:
        return
    refusal = _save_refusal(save, plan) if rank_and_world()[0] == 0 else None
    decided = all_gather(refusal)[0]
    if decided:
        raise CheckpointError(decided)
