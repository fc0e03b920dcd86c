"""Micro-batches of a dataset for one data-parallel rank, as Megatron-LM deals them.

Megatron-LM's ``MegatronPretrainingSampler`` walks the dataset in order from
``consumed_samples``; every ``micro_batch_size * dp_size`` consecutive samples
form one step, and rank r takes the r-th slice of ``micro_batch_size``. The
datasets are already shuffled by megatron (its shuffle index), so in-order is
right; an incomplete last step is dropped. Resuming is ``consumed_samples``.
"""
from __future__ import annotations

from typing import Dict, Iterator, List

import torch
from torch.utils.data import DataLoader, Dataset


class DataParallelBatchSampler:
    """Index lists of one rank's micro-batches (a ``batch_sampler`` for DataLoader)."""

    def __init__(self, total_samples: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, consumed_samples: int = 0) -> None:
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(f"micro_batch_size and dp_size must be >= 1, got {micro_batch_size}, {dp_size}.")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}.")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside the {total_samples}-sample dataset.")
        self.total_samples = total_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples

    def __len__(self) -> int:
        step = self.micro_batch_size * self.dp_size
        return (self.total_samples - self.consumed_samples) // step

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.dp_size
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        for k in range(len(self)):
            start = first + k * step
            yield list(range(start, start + self.micro_batch_size))


def iterate_micro_batches(dataset: Dataset, micro_batch_size: int, dp_rank: int = 0,
                          dp_size: int = 1, consumed_samples: int = 0,
                          num_workers: int = 0, pin_memory: bool = False) -> Iterator[Dict[str, torch.Tensor]]:
    """Yield this rank's micro-batches (CPU tensors): each sample field stacked along dim 0.

    For a GPTDataset: ``tokens``, ``labels``, ``position_ids`` ([b, s] int64) and
    ``loss_mask`` ([b, s] float32), plus ``attention_mask`` if the dataset makes one.
    ``pin_memory`` (on a GPU box) lets ``batch_to_device`` copy asynchronously.
    """
    sampler = DataParallelBatchSampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples)
    # A private generator: a DataLoader iterator draws its base seed from the one it
    # is given, and drawing from torch's default one would shift dropout's random
    # stream each time an iterator is made (breaking bit-exact resumes).
    return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                           persistent_workers=num_workers > 0, pin_memory=pin_memory,
                           generator=torch.Generator().manual_seed(consumed_samples)))


def batch_to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    """Every tensor of a micro-batch on ``device`` (the model's). From pinned memory
    the copy is asynchronous; on the same device nothing is copied."""
    return {key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for key, value in batch.items()}
