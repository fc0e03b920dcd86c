"""Megatron's ``--split``: the weights of the training, validation and test sets.

megatron-core reads ``"969,30,1"`` with a pattern that keeps only digits and dots,
so ``"2,-1,0"`` silently becomes 2,1,0, ``"a,b"`` becomes 0,0,0 (then NaN bounds:
``cannot convert float NaN to integer``) and four numbers fail a bare ``assert``.
``split_weights`` is the one check of the text, made before megatron reads it
again; ``split_bounds`` is where each set's documents start and end, megatron's
arithmetic (``convert_split_vector_to_split_matrix``, then ``round``) in plain
Python, so the data checks and the driver's suggestions need no megatron import.
Standard library only.
"""
from __future__ import annotations

import math
import re
from typing import List, Optional, Tuple

SET_NAMES = ("training", "validation", "test")


def split_weights(text: str) -> Tuple[float, float, float]:
    """The three weights of ``--split`` text (``,`` or ``/`` between them, missing
    ones 0), or ValueError saying what is wrong."""
    parts = [part.strip() for part in re.split(r"[,/]", str(text))]
    example = "e.g. 969,30,1 (training, validation, test)"
    if len(parts) > 3:
        raise ValueError(f"--split {text!r} has {len(parts)} weights; it takes at most 3, {example}")
    values: List[float] = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--split {text!r}: {part!r} is not a weight (a number >= 0), {example}")
        values.append(value)
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise ValueError(f"--split {text!r} gives every set weight 0, {example}")
    return values[0], values[1], values[2]


def split_bounds(weights: Tuple[float, float, float], num_documents: int) -> List[Optional[Tuple[int, int]]]:
    """``[begin, end)`` document indices of each set as megatron-core cuts them
    (None for a weight of 0)."""
    total = sum(weights)
    edges = [0.0]
    for weight in weights:
        edges.append(edges[-1] + weight / total)
    return [None if weight == 0 else (int(round(begin * num_documents)), int(round(end * num_documents)))
            for weight, begin, end in zip(weights, edges[:-1], edges[1:])]


def format_split(weights) -> str:
    """Weights as ``--split`` text: ``99,1,0``."""
    return ",".join(f"{w:g}" for w in weights)


def split_with_validation(num_documents: int) -> Optional[str]:
    """The ``--split`` with the smallest whole-percent validation weight (test 0) that
    gives both the training and the validation set a document of ``num_documents``;
    None when no split can (a single document)."""
    for percent in range(1, 100):
        weights = (100.0 - percent, float(percent), 0.0)
        train, valid, _ = split_bounds(weights, num_documents)
        if train[1] > train[0] and valid[1] > valid[0]:
            return format_split(weights)
    return None
