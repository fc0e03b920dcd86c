"""Checks every rank makes alike, with one outcome for all.

A check that fails on some ranks only (a file one node cannot see) must not leave
the others waiting in the next collective while the failing ones exit without a
word from rank 0: ``on_every_rank`` runs a check that does no collective of its
own, then the ranks share what they found, and every rank raises the first
failing rank's error, as ``AgreedError``, which the driver reports once.
"""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")


class AgreedError(ValueError):
    """A check failed; every rank raises this alike (so rank 0 alone reports it)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def on_every_rank(check: Callable[[], T], errors: tuple = (OSError, ValueError)) -> Optional[T]:
    """``check()``'s result; when it raised one of ``errors`` on any rank, every rank
    raises ``AgreedError`` with the first failing rank's message. ``check`` must do
    no collective (a rank that fails would not reach it)."""
    result, failure = None, None
    try:
        result = check()
    except errors as exc:
        failure = _first_line(exc)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        failures = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(failures, failure)
        failure = next((f for f in failures if f), None)
    if failure:
        raise AgreedError(failure)
    return result
