"""A build-once directory cache that is safe when several processes race.

A cached artifact is a directory that appears complete or not at all: it is built
under a temporary name next to its final place and renamed into place (rename of
a directory onto a missing name is atomic on POSIX). An advisory lock file keeps
the other processes of a job (every rank calls the same function) from building
the same thing in parallel; they wait, then find it done. Where locks do not
work (some network filesystems) the rename alone still keeps the result whole:
a loser of the race discards its copy and uses the winner's.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: rely on the atomic rename alone
    fcntl = None

CACHE_ENV = "SDP4BIT_CACHE"


def default_cache_dir() -> str:
    """``$SDP4BIT_CACHE`` if set, else ``~/.cache/megatron_sdp4bit``."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_sdp4bit"
    )


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path, "a+") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_once(final_dir: str, build: Callable[[str], None]) -> str:
    """Return ``final_dir``, first calling ``build(tmp_dir)`` if it does not exist.

    ``build`` writes everything into the empty ``tmp_dir`` it is given; the
    directory becomes ``final_dir`` only when ``build`` returns. If ``build``
    raises, nothing is left behind and the error propagates.
    """
    if os.path.isdir(final_dir):
        return final_dir
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    with _file_lock(final_dir + ".lock"):
        if os.path.isdir(final_dir):  # another process built it while we waited
            return final_dir
        tmp_dir = tempfile.mkdtemp(prefix=os.path.basename(final_dir) + ".tmp-", dir=parent)
        os.chmod(tmp_dir, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            build(tmp_dir)
            try:
                os.rename(tmp_dir, final_dir)
            except OSError:
                if not os.path.isdir(final_dir):
                    raise
                # Lost a race the lock could not prevent; the winner's copy is whole.
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir
