"""megatron's CUDA RNG tracker (``tensor_parallel/random.py``) on the CPU generator.

On CPU the tracker's "CUDA generator" is the CPU default generator, which is what
CPU dropout and CPU init draw from. megatron's own tracker keeps its bookkeeping
(named states, forks that restore the outer state): what it reads and writes of the
"CUDA generator" is redirected to the CPU one, nothing of it is reimplemented.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

_NO_GRAPH_SAFE = ("CPU backend: CUDA-graph-safe RNG states do not exist on CPU; "
                  "build the RNG tracker with use_cudagraphable_rng=False")


def cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU twin of ``random._get_cuda_rng_state``: the CPU default generator's state."""
    if graph_safe:
        raise ValueError(_NO_GRAPH_SAFE)
    return torch.get_rng_state()


def cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU twin of ``random._set_cuda_rng_state``."""
    if graph_safe:
        raise ValueError(_NO_GRAPH_SAFE)
    torch.set_rng_state(new_state)


CPU_GENERATOR_AS_CUDA = {"get_rng_state": cpu_get_rng_state, "manual_seed": torch.manual_seed}
"""``torch.cuda``'s generator functions that ``CudaRNGStatesTracker.add`` calls directly
(not through the module's ``_get_cuda_rng_state``), as the CPU generator's while it runs:
megatron's own ``add`` then seeds a named CPU generator state."""


class DropMessage(logging.Filter):
    """Drops one message from a logger: megatron's fork warns "CPU RNG state changed
    within GPU RNG context" when the CPU generator moved inside a fork, which on CPU,
    where the two generators are one, is every fork that draws (every dropout)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def seeding_the_cpu_generator_too(original: Callable, redirects) -> Callable:
    """``model_parallel_cuda_manual_seed`` that, while ``redirects`` is enabled, also seeds
    the CPU generator: its ``torch.cuda.manual_seed(seed)`` (the default, data-parallel
    state) is a silent no-op on CPU torch."""

    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs):
        if redirects.enabled:
            torch.manual_seed(seed)  # what torch.cuda.manual_seed(seed) does on a GPU
        return original(seed, *args, **kwargs)

    return redirects.marked(model_parallel_cuda_manual_seed, original)
