"""The patch layer's public entry points (a stable facade).

``install(config)`` routes megatron-core's bucket collectives through SDP4Bit's:
every bucket group of every model chunk (virtual-pipeline chunks included) is
covered. ``uninstall()`` restores megatron's methods; installing twice replaces
the configuration only. With quantization off, every swapped method defers to
megatron's own code, so training is bit-identical to stock megatron-core.

How: ``layer.py`` (the installed object and its swaps), ``grad_sync.py``,
``param_sync.py`` (the two collectives), ``state.py`` and ``quant_metrics.py``
(state and metrics), ``adapters/`` (everything that depends on the megatron-core
release). The installed layer is found through megatron's own classes, which
carry its methods: this module holds no state.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_sdp4bit.comm.accounting import WireStats
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron import adapters
from megatron_sdp4bit.megatron.checks import check_same_config_on_all_ranks
from megatron_sdp4bit.megatron.layer import SDP4BitLayer

__all__ = ["install", "uninstall", "is_installed", "current_config", "set_iteration",
           "get_iteration", "set_metrics_interval", "quantization_errors", "replica_checks_passed",
           "kernel_warm_up", "memory", "state_dict", "load_state_dict", "installed_layer",
           "drain"]


def installed_layer() -> Optional[SDP4BitLayer]:
    """The installed layer, or None."""
    return adapters.adapter_for(adapters.megatron_version(), force=True).installed_layer()


def install(config: SDP4BitConfig, force_version: bool = False) -> SDP4BitLayer:
    """Route megatron-core's bucket collectives through SDP4Bit's (idempotent).

    Call it before the model is wrapped in DistributedDataParallel. Every rank
    must call it: the check that all ranks pass the same config is collective (run
    here when torch.distributed is initialized, else at the first DDP construction).
    """
    if not isinstance(config, SDP4BitConfig):
        raise TypeError(f"install() takes an SDP4BitConfig, got {type(config).__name__}")
    adapter = adapters.current_adapter(force=force_version)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    layer = adapter.installed_layer()
    if layer is not None:
        layer.state.config = config
    else:
        layer = SDP4BitLayer(config, adapter)
    layer.state.resolve_ranks_per_node()  # once, here (or at DDP construction)
    if distributed:
        check_same_config_on_all_ranks(layer.state.config)
    layer.state.config_checked = distributed
    if not layer.is_installed:
        layer.install()
    return layer


def uninstall() -> None:
    """Restore megatron-core's own methods (safe when not installed)."""
    layer = installed_layer()
    if layer is not None:
        layer.uninstall()


def drain() -> None:
    """Wait until every collective the layer has started is done (its runner's queue:
    with --overlap-param-gather the weight gathers submitted at the optimizer step).
    Call it before reading the weights between a step and the next forward pass."""
    layer = installed_layer()
    if layer is not None:
        layer.state.runner.drain()


def is_installed() -> bool:
    return installed_layer() is not None


def current_config() -> Optional[SDP4BitConfig]:
    layer = installed_layer()
    return None if layer is None else layer.state.config


def set_iteration(iteration: int) -> None:
    """Tell the layer how many optimizer steps are done (after loading a checkpoint)."""
    layer = installed_layer()
    if layer is not None:
        layer.state.iteration = int(iteration)


def get_iteration() -> int:
    layer = installed_layer()
    return 0 if layer is None else layer.state.iteration


def set_metrics_interval(interval: int) -> None:
    """Sample the quantization errors on the last step of every ``interval`` steps
    (0, the default, samples never). Samples stay on the device until read."""
    layer = installed_layer()
    if layer is None:
        raise RuntimeError("set_metrics_interval() needs the layer installed (patch.install)")
    layer.state.metrics.set_interval(interval)


def quantization_errors() -> Dict[str, float]:
    """Latest sampled relative errors: ``weight`` (reconstructed vs exact main shard,
    after the all-gather) and ``grad_intra`` / ``grad_inter`` (each hop's quantizer
    on a slice of the local gradients). Empty until a sampled step ran."""
    layer = installed_layer()
    return {} if layer is None else layer.state.metrics.read()


def wire_stats() -> WireStats:
    """Bytes the installed layer's bucket collectives sent (and the exact ones would
    have) since install or the last ``reset_wire_stats``; empty without a layer."""
    layer = installed_layer()
    return WireStats() if layer is None else layer.state.wire.snapshot()


def reset_wire_stats() -> None:
    """Zero the installed layer's byte counters (e.g. at the start of a log window)."""
    layer = installed_layer()
    if layer is not None:
        layer.state.wire.reset()


def replica_checks_passed() -> int:
    """How many run-time replica checks (``check_interval``) found every
    data-parallel replica alike so far in this process (a mismatch raises)."""
    layer = installed_layer()
    return 0 if layer is None else layer.state.replica_checks_passed


def kernel_warm_up() -> tuple:
    """(kinds of kernel call compiled, seconds) when DDP was built: the Triton variants
    the collectives will launch, compiled then rather than in the first step; (n, 0.0)
    where the torch reference serves the device (nothing to compile)."""
    layer = installed_layer()
    return (0, 0.0) if layer is None else (len(layer.state.warmed_up), layer.state.warm_up_seconds)


def memory(optimizer, params: int):
    """``LayerMemory``: bytes the layer holds across steps and its scratch peak on this
    rank, for ``params`` model parameters here (collective over the DP group)."""
    from megatron_sdp4bit.megatron.memory import optimizer_memory

    layer = installed_layer()
    if layer is None:
        raise RuntimeError("memory() needs the layer installed (patch.install)")
    return optimizer_memory(layer, optimizer, params)


def state_dict(optimizer) -> dict:
    """The layer's part of a checkpoint (see ``SDP4BitLayer.state_dict``)."""
    layer = installed_layer()
    return {} if layer is None else layer.state_dict(optimizer)


def load_state_dict(state: dict, optimizer) -> None:
    layer = installed_layer()
    if layer is not None:
        layer.load_state_dict(state, optimizer)
