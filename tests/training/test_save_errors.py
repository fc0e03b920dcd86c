"""An OS error during a save (issue 18 item 5): one line naming the path and the errno on
every rank, the temporary folder removed, the last complete checkpoint loadable.

One forked world of 2 gloo ranks, saving every iteration:

- a real full disk: a tmpfs (mounted by rank 0, as root) that holds one
  checkpoint and a half; the second save runs out of space (ENOSPC). Before:
  raw torch tracebacks on every rank (``unexpected pos 64 vs 0``, ``basic_ios::clear``),
  no errno, and ``iter_*.tmp`` left behind. Then ``--load`` resumes from the
  first checkpoint;
- a real read-only folder: a tmpfs remounted read-only after the first save
  (EROFS);
- injected, where root cannot make a real one: EACCES and EDQUOT when rank 1
  opens its file (the OS refusing it).

Mounting needs root and the right to mount; elsewhere the real cases skip, saying so.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest

from driver_runs import TINY_GPT, captured_run, corpus_cache, driver_ranks, train_log
from megatron_sdp4bit.training.checkpoint import LATEST, MANIFEST, check_files, read_manifest

TINY = TINY_GPT + ["--lr-decay-iters", "3", "--bf16",
                   "--sdp4bit", "--sdp4bit-ranks-per-node", "1"]


def _mount(where: str, *options: str) -> str:
    """'' when mounted, else why not."""
    os.makedirs(where, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", where],
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@contextlib.contextmanager
def _refused_open(rank: int, target: str, code: int):
    """The OS refusing ``rank``'s rank-file creation under ``target`` with errno ``code``."""
    import torch

    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        name = os.path.basename(str(path))
        if (torch.distributed.get_rank() == rank and str(path).startswith(target)
                and name.startswith("rank_") and flags & os.O_CREAT):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    os.open = refusing
    try:
        yield
    finally:
        os.open = real_open


def _world(rank, world_size, root):
    import torch

    def go(name, flags, on_step=None):
        return captured_run(TINY + ["--run-dir", os.path.join(root, "runs", name)] + flags, on_step=on_step)

    def on_rank0(action):
        """``action()`` on rank 0 while the others wait; its result on every rank."""
        outcome = [action() if rank == 0 else None]
        torch.distributed.broadcast_object_list(outcome, src=0)
        return outcome[0]

    every_step = ["--save-interval", "1"]
    out = {"probe": go("probe", ["--train-iters", "1", "--save", os.path.join(root, "probe")])}
    small, read_only = os.path.join(root, "small"), os.path.join(root, "read_only")
    one_and_a_half = int(1.5 * _size(os.path.join(root, "probe", "iter_0000001"))) + 64 * 1024
    out["no_mount"] = on_rank0(lambda: _mount(small, f"size={one_and_a_half}") or _mount(read_only, "size=64m"))
    if not out["no_mount"]:
        out["full"] = go("full", ["--train-iters", "3", "--save", small] + every_step)
        out["resumed"] = go("resumed", ["--train-iters", "3", "--load", small])

        def remount_read_only(run):
            if run.iteration == 2:  # after the save of iteration 1, before that of 2
                on_rank0(lambda: subprocess.run(["mount", "-o", "remount,ro", read_only], check=True))

        out["read_only"] = go("read_only", ["--train-iters", "3", "--save", read_only] + every_step,
                              on_step=remount_read_only)
        out["read_only_listing"] = sorted(n for n in os.listdir(read_only) if not n.startswith("."))
    for name, code in (("eacces", errno.EACCES), ("edquot", errno.EDQUOT)):
        folder = os.path.join(root, name)
        with _refused_open(1, os.path.join(folder, "iter_0000002"), code):
            out[name] = go(name, ["--train-iters", "3", "--save", folder] + every_step)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("save_errors"))
    with corpus_cache(root):
        try:
            yield root, driver_ranks(_world, 2, root, timeout_s=900)
        finally:
            subprocess.run(["umount", os.path.join(root, "small")], capture_output=True)
            subprocess.run(["umount", os.path.join(root, "read_only")], capture_output=True)


def _no_temporary_folder(folder):
    return not [name for name in os.listdir(folder) if name.endswith(".tmp") or name.endswith(".part")]


def _assert_failed_at_2(results, folder, words):
    for result in results:
        error = result["error"]
        assert error is not None and "\n" not in error
        assert error.startswith(f"saving the checkpoint of iteration 2 to {folder} failed on rank "), error
        assert words in error, error
        assert error.endswith("its temporary folder was removed and the last complete checkpoint, "
                              "iteration 1, stays the latest. Free space or fix the folder, then resume "
                              f"with --load {folder}"), error


def _skip_without_tmpfs(results, what: str) -> None:
    if results[0]["no_mount"]:
        pytest.skip(f"cannot mount a tmpfs here ({results[0]['no_mount']}): the real {what} is not tested")


def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_last_checkpoint(world):
    root, results = world
    _skip_without_tmpfs(results, "full disk")
    small = os.path.join(root, "small")
    _assert_failed_at_2([r["full"] for r in results], small, "No space left on device (ENOSPC)")
    assert f"{small}/iter_0000002.tmp/rank_0000" in results[0]["full"]["error"]
    assert _no_temporary_folder(small)
    assert open(os.path.join(small, LATEST)).read().strip() == "1"
    assert check_files(os.path.join(small, "iter_0000001"), read_manifest(os.path.join(small, "iter_0000001"))) == []
    resumed = results[0]["resumed"]
    assert resumed["error"] is None, resumed["error"]
    assert f"resumed from {small} at iteration 1" in resumed["stdout"]
    first, again = train_log(os.path.join(root, "runs"), "full"), train_log(os.path.join(root, "runs"), "resumed")
    assert again[2] == first[2]  # the same step 2 as before the failed save


def test_a_folder_turned_read_only_fails_the_save_in_one_line(world):
    root, results = world
    _skip_without_tmpfs(results, "EROFS")
    folder = os.path.join(root, "read_only")
    _assert_failed_at_2([r["read_only"] for r in results], folder, "Read-only file system (EROFS)")
    assert results[0]["read_only_listing"] == sorted([LATEST, "iter_0000001"])


@pytest.mark.parametrize("name, words", [("eacces", "Permission denied (EACCES)"),
                                         ("edquot", "Disk quota exceeded (EDQUOT)")])
def test_an_injected_os_error_on_one_rank_fails_the_save_on_every_rank(world, name, words):
    root, results = world
    folder = os.path.join(root, name)
    _assert_failed_at_2([r[name] for r in results], folder, words)
    for result in results:
        assert f"failed on rank 1: {folder}/iter_0000002.tmp/rank_00001.pt.part: {words}" in result[name]["error"]
    assert _no_temporary_folder(folder) and open(os.path.join(folder, LATEST)).read().strip() == "1"
    assert os.path.isfile(os.path.join(folder, "iter_0000001", MANIFEST))
