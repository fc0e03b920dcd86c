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
from typing import Callable, Iterator, Optional

try:
    import fcntl
except ImportError:  # not POSIX: rely on the atomic rename alone
    fcntl = None

CACHE_ENV = "SDP4BIT_CACHE"
CACHE_CONTENTS = "the embedded corpus, its tokenizer and the dataset index files"
"""What the cache folder holds, for the messages and --help texts that name it."""


class CacheFolderError(ValueError):
    """A cache folder cannot be written; the message names it, what it is for and
    how to move it (a ValueError: the command lines report it in one line)."""


def default_cache_dir() -> str:
    """``$SDP4BIT_CACHE`` if set, else ``~/.cache/megatron_sdp4bit``."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_sdp4bit"
    )


def cache_error(folder: str, error: OSError, what: str = CACHE_CONTENTS,
                flag: Optional[str] = None) -> CacheFolderError:
    """The one line for a cache ``folder`` that cannot be written: the folder, the OS's
    words, what it holds, and how to move it (``flag`` when the folder came from one,
    else ``$SDP4BIT_CACHE``)."""
    why = error.strerror or str(error)
    move = (f"pass a writable {flag}" if flag else
            f"set {CACHE_ENV} to a writable folder (e.g. {CACHE_ENV}=/tmp/sdp4bit-cache)")
    return CacheFolderError(f"cannot write {folder} ({why}): it is megatron_sdp4bit's cache of {what}; {move}")


def check_writable(folder: str, what: str = CACHE_CONTENTS, flag: Optional[str] = None) -> str:
    """``folder``, created if missing, after writing and removing a file in it; else
    ``CacheFolderError`` (see ``cache_error``)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as error:
        raise cache_error(folder, error, what, flag) from None
    return folder


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
