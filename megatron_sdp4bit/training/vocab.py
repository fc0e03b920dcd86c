"""The vocabulary as the model holds it: padded as Megatron-LM pads it.

Pure arithmetic with no imports, so that the driver's model (``model.py``) and the
planner (``estimate/gpt_shape.py``), which starts no process, share the one rule without
the planner importing megatron.
"""
from __future__ import annotations

VOCAB_PAD_MULTIPLE = 128
"""Megatron-LM's ``--make-vocab-size-divisible-by`` default; times the TP size."""


def padded_vocab_size(vocab_size: int, tensor_parallel: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of 128 x TP (each TP rank holds an equal
    slice of the embedding)."""
    multiple = VOCAB_PAD_MULTIPLE * tensor_parallel
    return -(-vocab_size // multiple) * multiple
