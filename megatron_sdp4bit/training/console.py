"""Printing from a job of many ranks: what every rank knows alike is said once, by rank 0.

``outlive_the_console()`` (the driver, first thing) lets a run go on when its
console goes away: a terminal that closed (writes fail with EIO), the reader of
``torchrun ... | tee log`` that was stopped with the job (EPIPE; Python ignores
SIGPIPE). Without it the first log line after that raised, and a run stopping on
the hang-up or the Ctrl-C that came with it died before its save.
"""
from __future__ import annotations

import sys

import torch


def is_rank0() -> bool:
    """Rank 0 of the job, or the only process when there is no process group."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def log0(*args) -> None:
    if is_rank0():
        print(*args, flush=True)


class _Console:
    """A text stream that drops what it cannot write once its reader is gone."""

    def __init__(self, stream):
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError:
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError:
                self.gone = True

    def __getattr__(self, name):
        return getattr(self._stream, name)


def outlive_the_console() -> None:
    """``sys.stdout`` and ``sys.stderr`` drop their output once it cannot be written."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Console):
            setattr(sys, name, _Console(stream))
