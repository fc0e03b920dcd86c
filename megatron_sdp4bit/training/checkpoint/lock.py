"""One job at a time saves into a ``--save`` folder.

Two jobs writing one folder (a job started twice, a copy-pasted command) replace
each other's checkpoints and tracker. Rank 0 takes an exclusive ``flock`` on
``SAVE/.sdp4bit-save.lock`` before anything is built and holds it until training
ends; a second job's rank 0 finds it taken and every rank of that job stops,
naming the holder (pid, host, since when). The operating system releases the
lock when the holding process dies, so a killed job leaves nothing stale behind.
A filesystem without locks (some network mounts) is said once and not locked.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

from megatron_sdp4bit.training.checkpoint.common import CheckpointError, all_gather, rank_and_world
from megatron_sdp4bit.training.console import log0

LOCK = ".sdp4bit-save.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


class SaveLock:
    """The lock on one ``--save`` folder, held by this process (rank 0) while open."""

    def __init__(self, save_dir: str):
        self.path = os.path.join(save_dir, LOCK)
        self._file = None

    def acquire(self) -> Optional[str]:
        """None when held now (or locks are not supported); else why not, in one line."""
        folder = os.path.dirname(self.path)
        try:
            with open(self.path, "a"):  # exists; the lock itself is held through a
                pass                    # read-only handle: no open writer on the folder
            handle = open(self.path)
        except OSError as exc:
            return f"--save {folder} cannot be locked: {exc.strerror} ({self.path})"
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(self.path)
            handle.close()
            if exc.errno in _NO_LOCKS:
                log0(f"warning: --save {folder} cannot be locked ({exc.strerror}): a second job saving there "
                     "would not be noticed")
                return None
            return (f"--save {folder} is being written by another job ({holder}): two jobs saving into one "
                    "folder replace each other's checkpoints; wait for it to end, or choose another --save")
        self._file = handle
        try:
            with open(self.path, "w") as f:  # who holds it, for the next job's message
                json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
        except OSError:
            pass
        return None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the file releases the flock
            self._file = None


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            owner = json.load(f)
        return f"pid {owner['pid']} on {owner['host']}, since {owner['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid unknown"


def lock_save_folder(save_dir: Optional[str]) -> Optional[SaveLock]:
    """Collective: the lock on ``save_dir`` (held by rank 0; None on the other ranks and
    without ``--save``), or ``CheckpointError`` on every rank when another job holds it."""
    if not save_dir:
        return None
    lock = SaveLock(save_dir) if rank_and_world()[0] == 0 else None
    refusal = lock.acquire() if lock is not None else None
    decided = all_gather(refusal)[0]
    if decided:
        raise CheckpointError(decided)
    return lock
