"""Every random-number state a resume needs to continue the same run.

The CUDA state saved is this rank's device's only (one tensor). Saving every visible
GPU's state (``get_rng_state_all``) tied a checkpoint to the process's view of the
node: a resume that sees fewer GPUs failed with an IndexError, and one with another
rank-to-GPU mapping restored another GPU's stream.
"""
from __future__ import annotations

import random
from typing import Optional, Sequence, Union

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron_sdp4bit.training.checkpoint.common import CheckpointError


def rng_state() -> dict:
    """Python's, NumPy's, torch's (CPU and this rank's CUDA device) and megatron's RNG tracker's states."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def this_device_cuda_state(saved: Union[torch.Tensor, Sequence[torch.Tensor]], device: int) -> torch.Tensor:
    """The CUDA RNG state to restore on ``device`` from a checkpoint's ``saved`` entry: one
    tensor (this rank's device's, as saved now), or the list of every GPU's state that
    older checkpoints hold, of which the entry at ``device`` (the device this rank saved
    from, when the rank-to-GPU mapping is the same)."""
    if isinstance(saved, torch.Tensor):
        return saved
    if device >= len(saved):
        raise CheckpointError(
            f"the checkpoint holds the CUDA RNG states of {len(saved)} GPUs (an older format) and this "
            f"rank uses GPU {device}: resume with the same GPUs visible to each process as at the save")
    return saved[device]


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    saved_cuda: Optional[object] = state.get("cuda")
    if saved_cuda is not None and torch.cuda.is_available():
        device = torch.cuda.current_device()
        torch.cuda.set_rng_state(this_device_cuda_state(saved_cuda, device), device)
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
