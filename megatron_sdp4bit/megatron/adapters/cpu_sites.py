"""What the CPU backend redirects in a megatron-core release, as typed records.

An adapter's ``cpu_backend_sites()`` returns a ``CoreSites`` (megatron-core) and its
``cpu_training_sites()`` a ``TrainingSites`` (Megatron-LM's ``megatron.training``, or
None where that is not worked out); ``megatron_sdp4bit.cpu_backend`` applies them.
The objects are megatron's own (modules, classes, functions), looked up by the
adapter, so a site that moved fails in the adapter, by name. Why each is redirected
is written in ``cpu_backend/core.py`` and ``cpu_backend/megatron_training.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Tuple

Site = Tuple[Any, str]
"""(owner, attribute name): a method of a class or a function of a module."""


@dataclass(frozen=True)
class RngSites:
    """The tensor-parallel RNG tracker (``tensor_parallel/random.py``)."""

    module: ModuleType
    """The module that holds the CUDA RNG-state functions."""
    get_state: str
    """Name of its "get the CUDA RNG state" function (``_get_cuda_rng_state``)."""
    set_state: str
    """Name of its "set the CUDA RNG state" function (``_set_cuda_rng_state``)."""
    tracker: type
    """The tracker class (``CudaRNGStatesTracker``), whose ``add`` runs with ``torch.cuda``'s
    generator functions as the CPU generator's."""
    fork_logger: str
    """The logger the tracker's ``fork`` warns on (its module's)."""
    fork_warning: str
    """What ``fork`` warns when the CPU generator moved inside it: on CPU, every draw."""
    seed_function: Callable
    """``model_parallel_cuda_manual_seed``, rebound wherever megatron binds it."""


@dataclass(frozen=True)
class CoreSites:
    """Every place megatron-core names CUDA on the path the CPU backend runs."""

    rng: RngSites
    type_named_inits: Tuple[type, ...]
    """Classes whose ``__init__`` compares ``param.type()`` with CUDA type names (and
    holds ``device='cuda'`` literals)."""
    inits: Tuple[type, ...]
    """Classes whose ``__init__`` holds ``device='cuda'`` literals only."""
    type_named_functions: Tuple[Callable, ...]
    """Module functions with type-name checks, rebound wherever megatron binds them."""
    functions: Tuple[Callable, ...]
    """Module functions with literals, rebound wherever megatron binds them."""
    methods: Tuple[Site, ...] = ()
    """Methods with literals (plain, static or class methods)."""


@dataclass(frozen=True)
class TrainingSites:
    """What the CPU mode of ``megatron.training`` redirects (numbers as in its docstring)."""

    initialize_megatron: Callable
    """1. Called with ``allow_no_cuda=True`` and the gloo backend."""
    one_device: Tuple[Site, ...]
    """2. While each runs, ``torch.cuda`` has one device and selecting it does nothing."""
    jit_warmup: Site
    """3. Does nothing (GPU fusion kernels)."""
    checkpoint_rng: Tuple[Callable, ...]
    """4. While each runs, the "CUDA generator" is the CPU one, rebound likewise
    (``checkpointing.get_rng_state`` for a save, ``load_checkpoint`` for a load)."""
    rng_save_restore: Tuple[Site, ...]
    """5. While each runs, the "CUDA generator" is the CPU one."""
    device_arch: Callable
    """6. Answers 0 (no CUDA architecture), rebound wherever megatron binds it."""
    pretrain: Callable
    """7. Runs under the device mode (CUDA ``device=`` -> CPU), rebound likewise."""
    optimizer_state_setter: Site = None
    """8. The distributed optimizer's per-parameter state setter of a ``--ckpt-format
    torch`` load: keeps the states the file does not hold (torch AdamW's ``step``)."""
    optimizer_state_dict: Site = None
    """9. The distributed optimizer's ``state_dict`` (a ``torch_dist`` load's template):
    states made before any step get torch AdamW's ``step`` (0)."""
    validate_args: Callable = None
    """11. ``validate_args`` (rebound wherever megatron binds it): before it runs, the
    arguments set to what CPU can run (``CPU_SETTINGS``)."""
    checkpoint_worker: Site = None
    """10. The persistent checkpoint worker's loop (``--use-persistent-ckpt-worker``), a
    static method started in a spawned process: there it runs with ``torch.cuda`` as one
    CPU "device"."""
