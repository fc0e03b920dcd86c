"""CPU twins of megatron's CUDA RNG tracker (``tensor_parallel/random.py``).

On CPU the tracker's "CUDA generator" is the CPU default generator, which is what
CPU dropout and CPU init draw from; the twins keep megatron's bookkeeping (named
states, forks that restore the outer state) on it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

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


def cpu_tracker_add(self, name: str, seed: int) -> None:
    """CPU twin of ``CudaRNGStatesTracker.add``: a named CPU generator state from ``seed``."""
    if getattr(self, "use_cudagraphable_rng", False):
        raise ValueError(_NO_GRAPH_SAFE)
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    outer_state = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(outer_state)


def cpu_tracker_fork(default_name: str) -> Callable:
    """CPU twin of ``CudaRNGStatesTracker.fork``, minus the original's "CPU RNG state
    changed within GPU RNG context" warning, which on CPU would fire on every dropout
    since both generators are one."""

    @contextlib.contextmanager
    def fork(self, name: str = default_name) -> Iterator[None]:
        """Draw from state ``name``, then restore the outer state."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current state name {self._current_state_name} is not the "
                                f"same as the desired state name {name}.")
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    return fork


def seeding_the_cpu_generator_too(original: Callable, redirects) -> Callable:
    """``model_parallel_cuda_manual_seed`` that, while ``redirects`` is enabled, also seeds
    the CPU generator: its ``torch.cuda.manual_seed(seed)`` (the default, data-parallel
    state) is a silent no-op on CPU torch."""

    def model_parallel_cuda_manual_seed(seed: int, *args, **kwargs):
        if redirects.enabled:
            torch.manual_seed(seed)  # what torch.cuda.manual_seed(seed) does on a GPU
        return original(seed, *args, **kwargs)

    return redirects.marked(model_parallel_cuda_manual_seed, original)
