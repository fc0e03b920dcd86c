"""How much of each dataset a run reads: tokens per set, samples asked, epochs.

megatron-core repeats a dataset (reshuffled) as often as the samples asked need,
without a word: a corpus smaller than one sequence trains for hundreds of epochs
on copies of itself. Two cases it does not repeat: several ``--data-path``
prefixes without weights are read once each (the blend is cut at the sum of one
epoch of each, and training then runs out of samples part way, ``StopIteration``),
and a dataset smaller than one sample gives that blend a weight of 0 (a bare
``assert``). ``check_coverage`` refuses those with numbers and what to do;
``training_reads`` gives the driver the epochs to warn about.

Reads the ``.idx`` only (4 bytes per sequence); standard library and NumPy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

from megatron_sdp4bit.data.indexed_files import check_indexed_prefix, sequence_lengths
from megatron_sdp4bit.data.splits import SET_NAMES, split_bounds, split_weights

SURPLUS = 0.005
"""megatron-core's ``mid_level_dataset_surplus``: a weighted blend asks each dataset
for this much more than its share."""


@dataclass(frozen=True)
class SetRead:
    """What a run asks of one dataset's training, validation or test set."""

    prefix: str
    set_name: str
    tokens: int
    """Tokens in the set (its documents, as megatron-core cuts the split)."""
    samples: int
    """Samples the run asks of it."""
    seq_length: int

    @property
    def samples_per_epoch(self) -> int:
        """Samples one pass over the set gives (each reads ``seq_length + 1`` tokens,
        consecutive samples sharing one)."""
        return max(self.tokens - 1, 0) // self.seq_length

    @property
    def epochs(self) -> float:
        """How many times the run reads the set (megatron rounds up to whole epochs)."""
        return (self.samples * self.seq_length + 1) / self.tokens if self.tokens else math.inf


def set_tokens(prefix: str, split: str) -> List[Optional[int]]:
    """Tokens of the training, validation and test sets of ``prefix`` (None: weight 0)."""
    lengths = sequence_lengths(prefix)
    return [None if bounds is None else int(lengths[bounds[0]:bounds[1]].sum(dtype="int64"))
            for bounds in split_bounds(split_weights(split), len(lengths))]


def _samples_per_prefix(weights: Optional[Sequence[float]], count: int, samples: int) -> List[int]:
    """megatron-core's share of ``samples`` for each of ``count`` datasets of a weighted
    blend (with its surplus), or all of them for one unweighted dataset."""
    if weights is None:
        return [samples] * count
    total = sum(weights)
    return [int(math.ceil(math.ceil(samples * w / total) * (1 + SURPLUS))) for w in weights]


def set_reads(prefixes: Sequence[str], weights: Optional[Sequence[float]], split: str,
              seq_length: int, sizes: Sequence[Optional[int]]) -> List[SetRead]:
    """One ``SetRead`` per prefix and set asked for samples (``sizes``: per set, None or
    0 = not read)."""
    reads = []
    for i, prefix in enumerate(prefixes):
        for name, tokens, size in zip(SET_NAMES, set_tokens(prefix, split), sizes):
            if tokens is not None and size:
                share = _samples_per_prefix(weights, len(prefixes), size)[i]
                reads.append(SetRead(prefix, name, tokens, share, seq_length))
    return reads


def check_coverage(prefixes: Sequence[str], weights: Optional[Sequence[float]], split: str,
                   seq_length: int, sizes: Sequence[Optional[int]],
                   needed: Optional[Sequence[Optional[int]]] = None) -> List[SetRead]:
    """The reads of ``set_reads``, after refusing (ValueError, one line) a set smaller
    than one sample, and an unweighted blend with fewer samples than a set's
    ``needed`` (default ``sizes``: what the reader walks through; the driver's
    evaluations re-read their first batches)."""
    reads = set_reads(prefixes, weights, split, seq_length, sizes)
    for read in reads:
        if read.samples_per_epoch < 1:
            raise ValueError(
                f"the {read.set_name} set of {read.prefix} holds {read.tokens} tokens, fewer than one "
                f"sample of --seq-length {seq_length} (+1): every sample would repeat it; use more data "
                f"or a --seq-length of at most {max(read.tokens - 1, 1)}")
    if weights is None and len(prefixes) > 1:
        for name, size in zip(SET_NAMES, sizes if needed is None else needed):
            mine = [r for r in reads if r.set_name == name]
            available = sum(r.samples_per_epoch for r in mine)
            if mine and size and size > available:
                pairs = " ".join(f"1 {p}" for p in prefixes)
                raise ValueError(
                    f"--data-path of {len(prefixes)} prefixes without weights is read once (megatron-core "
                    f"does not repeat such a blend): their {name} sets hold {available} samples of "
                    f"--seq-length {seq_length}, the run reads {size}; give them weights, which repeat "
                    f"them as needed (e.g. --data-path {pairs}), or read fewer samples")
    return reads
