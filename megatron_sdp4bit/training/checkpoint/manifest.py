"""The manifest of a checkpoint, verification of its files, and which checkpoint to load.

A checkpoint's ``manifest.json`` is written last: the run's layout and every
file's size and SHA-256. Verification is collective: the ranks split the
manifest's files, check them and share what they found, so every rank gets the
same answer. ``choose_checkpoint`` picks the checkpoint a ``--load`` folder names
and, when it is damaged, offers (or, with ``fallback``, takes) the newest earlier
one that verifies.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import List, Optional, Tuple

from megatron_sdp4bit.training.checkpoint.common import (
    ITER_DIR, LATEST, MANIFEST, MANIFEST_FORMAT, CheckpointError, all_gather, iter_dir, rank_and_world,
    rank_file)
from megatron_sdp4bit.training.console import log0


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


def write_manifest(directory: str, iteration: int, layout: dict, entries: list) -> None:
    """``manifest.json`` of ``entries`` (name, size, SHA-256), written whole or not at all."""
    manifest = {"format": MANIFEST_FORMAT, "iteration": iteration, "layout": layout,
                "files": {name: {"bytes": size, "sha256": sha} for name, size, sha in entries}}
    path = os.path.join(directory, MANIFEST)
    with open(path + ".part", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


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


def _problems_seen_here(directory: str) -> Tuple[Optional[dict], List[str]]:
    """This rank's share of the verification: (manifest, what is wrong)."""
    rank, world = rank_and_world()
    if not os.path.isdir(directory):
        return None, [f"{os.path.basename(directory)} is missing"]
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        return None, [str(exc)]
    if manifest is None:
        if not os.path.isfile(rank_file(directory, 0)):
            return None, [f"it has neither {MANIFEST} nor rank_00000.pt"]
        return None, []
    try:
        return manifest, check_files(directory, manifest, rank, world)
    except Exception as exc:  # every rank must reach the gather that follows
        return manifest, [f"cannot check it ({type(exc).__name__}: {exc})"]


def verify(directory: str) -> Tuple[Optional[dict], Optional[str]]:
    """Collective: (manifest, None) for a checkpoint whose files are as saved,
    (None, None) for one without a manifest (an older save: unverified),
    (None, what is wrong) otherwise. The same answer on every rank."""
    manifest, problems = _problems_seen_here(directory)
    everyone = sorted({p for found in all_gather(problems) for p in found})
    if everyone:
        shown = everyone[:3] + ([f"and {len(everyone) - 3} more"] if len(everyone) > 3 else [])
        return None, "; ".join(shown)
    return manifest, None


def checkpoint_iterations(load_dir: str) -> List[int]:
    """The iterations of the ``iter_*`` folders in ``load_dir``, newest first
    (``iter_*.tmp`` leftovers of killed saves are not checkpoints)."""
    found = []
    for name in os.listdir(load_dir):
        match = ITER_DIR.match(name)
        if match and os.path.isdir(os.path.join(load_dir, name)):
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def _previous_complete(load_dir: str, below: Optional[int], damaged: List[int]) -> Optional[Tuple[str, dict]]:
    """Collective: the newest checkpoint below iteration ``below`` (any, when None)
    whose manifest verifies; those passed over are added to ``damaged``."""
    for iteration in checkpoint_iterations(load_dir):
        if below is not None and iteration >= below:
            continue
        candidate = iter_dir(load_dir, iteration)
        manifest, problem = verify(candidate)
        if problem is None and manifest is not None:
            return candidate, manifest
        damaged.append(iteration)
    return None


def megatron_lm_format(directory: str) -> Optional[str]:
    """``"torch"`` or ``"torch_dist"`` when ``directory`` is a checkpoint Megatron-LM wrote
    (``mp_rank_XX/model_optim_rng.pt``; ``*.distcp`` shards), which the driver cannot
    read; None otherwise."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if any(name.startswith("mp_rank_") for name in names):
        return "torch"
    if any(name.endswith(".distcp") for name in names):
        return "torch_dist"
    return None


def _refuse_megatron_lm(directory: str) -> None:
    """Collective: rank 0's look decides (``directory`` on a filesystem all ranks share)."""
    found = all_gather(megatron_lm_format(directory) if rank_and_world()[0] == 0 else None)[0]
    if found:
        raise CheckpointError(
            f"checkpoint {directory} is Megatron-LM's ({found} format), which this driver does not read (its "
            f"own are rank_NNNNN.pt files and {MANIFEST}): resume it with Megatron-LM and SDP4Bit's flags "
            "(python -m megatron_sdp4bit.launch PATH/TO/pretrain_gpt.py ... --sdp4bit), or drop --load to start "
            "this driver from scratch")


def _wanted(load_dir: str, iteration: Optional[int]) -> Tuple[Optional[int], str]:
    """(the iteration to load, how it was named): the pinned one, the tracker's, or,
    without a tracker file, the newest ``iter_*`` folder; None when the tracker holds
    no number (the second value then says so)."""
    if iteration is not None:
        return iteration, ""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        found = checkpoint_iterations(load_dir)
        return (found[0] if found else None), f"{load_dir} has no checkpoint"
    text = open(path).read().strip()
    if text.isdigit():
        return int(text), ""
    return None, f"{path} holds {text!r}, not an iteration number"


def choose_checkpoint(load_dir: str, fallback: bool,
                      iteration: Optional[int] = None) -> Tuple[str, Optional[dict], List[int]]:
    """Collective: (the directory to load, its manifest, the iterations found damaged on
    the way). ``iteration``: that checkpoint (``--load DIR/iter_N``); else the one the
    tracker file names, or the newest without one. A damaged one is an error that
    names the newest earlier complete checkpoint, which ``fallback`` loads instead."""
    wanted, unreadable = _wanted(load_dir, iteration)
    damaged: List[int] = []
    if wanted is not None:
        directory = iter_dir(load_dir, wanted)
        _refuse_megatron_lm(directory)
        manifest, problem = verify(directory)
        if problem is None:
            if manifest is None:
                log0(f"warning: {directory} has no {MANIFEST} (saved by an older version): its files "
                     "are not verified, its layout is taken from its rank files and its data settings "
                     "are not checked")
            return directory, manifest, damaged
        damaged.append(wanted)
        unreadable = f"checkpoint {directory} is damaged: {problem}"
    previous = _previous_complete(load_dir, wanted, damaged)
    if previous is None:
        raise CheckpointError(f"{unreadable}. There is no earlier complete checkpoint in {load_dir}")
    if not fallback:
        raise CheckpointError(
            f"{unreadable}. The previous complete checkpoint is {previous[0]} (iteration "
            f"{previous[1]['iteration']}): rerun with --load-fallback to resume from it")
    log0(f"--load-fallback: {unreadable}; loading the previous complete checkpoint, {previous[0]} "
         f"(iteration {previous[1]['iteration']})")
    return previous[0], previous[1], damaged
