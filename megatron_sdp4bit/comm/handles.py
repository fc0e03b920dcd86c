"""Async handles shaped like ``torch.distributed.Work``.

``PendingCollective`` is a handle whose ``wait()`` runs a small piece of work once
(the copy of a one-rank "collective", gloo's division after an AVG all-reduce);
a second ``wait()`` is a no-op. The quantized collectives' own handles come from
their runner (``runner.py``).
"""
from __future__ import annotations

from typing import Callable, Optional


class PendingCollective:
    """A launched collective; ``wait()`` runs ``finish`` once and returns True."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Optional[Callable[[], None]] = finish

    def wait(self, timeout=None) -> bool:  # noqa: ARG002  (torch.Work takes a timeout too)
        """Complete the collective: remaining hops and the dequantize into the output."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        """True once ``wait()`` has run (the final tensor math happens inside it)."""
        return self._finish is None


def finish_or_handle(finish: Callable[[], None], async_op: bool) -> Optional[PendingCollective]:
    """torch's convention: run to completion and return None, or return a handle."""
    handle = PendingCollective(finish)
    if async_op:
        return handle
    handle.wait()
    return None


def wait_all(works) -> None:
    for work in works:
        if work is not None:
            work.wait()
