"""An allocation that fails, said in one line that names what to lower.

torch raises ``torch.OutOfMemoryError`` on a GPU and a plain ``RuntimeError`` from
its CPU allocator (``DefaultCPUAllocator: can't allocate memory: you tried to
allocate N bytes``); either ended the driver with a traceback on every rank that
met it. ``says_out_of_memory(where, advice)`` turns them into ``OutOfMemory``,
which the driver reports as one line per failing rank (a rank that fails alone
is not waited for: the others are inside a collective with it).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"

def lower_the_micro_batch(micro_batch_size: int, global_batch_size: int) -> str:
    """The fix for a step that does not fit: activations grow with the micro-batch,
    and the global batch (what the run trains on) need not change with it."""
    return (f"lower --micro-batch-size {micro_batch_size} and keep --global-batch-size {global_batch_size}: "
            "each rank then runs more, smaller micro-batches per iteration and trains the same samples")


class OutOfMemory(RuntimeError):
    """An allocation failed; the message says where and what to change."""


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and CPU_ALLOCATOR in str(error))


def _allocator_words(error: BaseException) -> str:
    """torch's first line, which says how much it tried to allocate."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def says_out_of_memory(where: str, advice: str) -> Iterator[None]:
    """Inside: an allocation failure raises ``OutOfMemory``: ``out of memory WHERE
    (torch's words): ADVICE``. Other errors pass through unchanged."""
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        if not (is_out_of_memory(error) or isinstance(error, MemoryError)):
            raise
        raise OutOfMemory(f"out of memory {where} ({_allocator_words(error)}): {advice}") from None
