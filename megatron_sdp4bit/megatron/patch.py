"""The patch layer's public entry points (a stable facade).

``install(config)`` routes megatron-core's bucket collectives through SDP4Bit's:
every bucket group of every model chunk (virtual-pipeline chunks included) is
covered. ``uninstall()`` restores megatron's methods; installing twice replaces
the configuration only. With quantization off, every swapped method defers to
megatron's own code, so training is bit-identical to stock megatron-core.

How: ``layer.py`` (the installed object and its swaps), ``grad_sync.py``,
``param_sync.py`` (the two collectives), ``state.py`` and ``quant_metrics.py``
(state and metrics), ``adapters/`` (everything that depends on the megatron-core
release). Which layer is installed is ``installed.INSTALLED``'s record, written by
``install`` / ``uninstall`` only; the other functions here read it and hand out what
callers need (figures, the config, the checkpoint state, the optimizer's group), not
the layer. Without a layer they say so: the readers answer "nothing" (None, 0, empty),
the functions that need one raise, naming ``install``.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_sdp4bit.comm.accounting import WireStats
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron import adapters
from megatron_sdp4bit.megatron.config_refusals import check_same_config_on_all_ranks
from megatron_sdp4bit.megatron.group_handle import WaitClock
from megatron_sdp4bit.megatron.installed import INSTALLED
from megatron_sdp4bit.megatron.layer import SDP4BitLayer

__all__ = ["install", "uninstall", "is_installed", "current_config", "adapter_minor", "set_iteration",
           "get_iteration", "set_metrics_interval", "quantization_errors",
           "gradient_group_shape", "wire_stats",
           "replica_checks_passed", "kernel_warm_up", "memory", "state_dict", "main_shards_refusal",
           "load_state_dict",
           "optimizer_group", "after_optimizer_load", "drain", "collective_plan", "collective_waits"]


def install(config: SDP4BitConfig, force_version: bool = False) -> SDP4BitLayer:
    """Route megatron-core's bucket collectives through SDP4Bit's (idempotent).

    Call it before the model is wrapped in DistributedDataParallel. Every rank
    must call it: the check that all ranks pass the same config is collective (run
    here when torch.distributed is initialized, else at the first DDP construction).
    Returns the installed layer, for tests and tools that look inside it; everything
    else uses this module's functions.
    """
    if not isinstance(config, SDP4BitConfig):
        raise TypeError(f"install() takes an SDP4BitConfig, got {type(config).__name__}")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    layer = INSTALLED.layer
    if layer is not None:
        layer.state.config = config
    else:
        layer = SDP4BitLayer(config, adapters.current_adapter(force=force_version))
    layer.state.resolve_ranks_per_node()  # once, here (or at DDP construction)
    if distributed:
        check_same_config_on_all_ranks(layer.state.config)
    layer.state.config_checked = distributed
    if not layer.is_installed:
        layer.install()  # undoes itself when it fails: nothing is recorded then
    INSTALLED.layer = layer
    return layer


def uninstall() -> None:
    """Restore megatron-core's own methods (safe when not installed); afterwards
    ``is_installed()`` is False and the facade answers as without a layer."""
    layer, INSTALLED.layer = INSTALLED.layer, None
    if layer is not None:
        layer.uninstall()


def drain() -> None:
    """Wait until every collective the layer has started is done (its runner's queue:
    with --overlap-param-gather the weight gathers submitted at the optimizer step).
    Call it before reading the weights between a step and the next forward pass."""
    layer = INSTALLED.layer
    if layer is not None:
        layer.state.runner.drain()


def is_installed() -> bool:
    return INSTALLED.layer is not None


def current_config() -> Optional[SDP4BitConfig]:
    layer = INSTALLED.layer
    return None if layer is None else layer.state.config


def adapter_minor() -> Optional[str]:
    """The megatron-core release (``"0.19"``) whose adapter the installed layer uses."""
    layer = INSTALLED.layer
    return None if layer is None else layer.adapter.minor


def set_iteration(iteration: int) -> None:
    """Tell the layer how many optimizer steps are done (after loading a checkpoint)."""
    layer = INSTALLED.layer
    if layer is not None:
        layer.state.iteration = int(iteration)


def get_iteration() -> int:
    layer = INSTALLED.layer
    return 0 if layer is None else layer.state.iteration


def set_metrics_interval(interval: int) -> None:
    """Sample the quantization errors on the last step of every ``interval`` steps
    (0, the default, samples never). Samples stay on the device until read."""
    INSTALLED.require("set_metrics_interval()").state.metrics.set_interval(interval)


def quantization_errors() -> Dict[str, float]:
    """Latest sampled relative errors: ``weight`` (reconstructed vs exact main shard,
    after the all-gather) and ``grad_intra`` / ``grad_inter`` (each hop's quantizer
    on a slice of the local gradients). Empty until a sampled step ran."""
    layer = INSTALLED.layer
    return {} if layer is None else layer.state.metrics.read()


def gradient_group_shape() -> Dict[str, float]:
    """The gradients' 4-bit groups on the sampled steps since the last read (all
    buffers): crest factors and the 4-bit error without / with the Hadamard rotation
    (``quant_metrics.QuantErrorMetrics.read_group_shape``). Empty until a sampled
    step quantized gradients."""
    layer = INSTALLED.layer
    return {} if layer is None else layer.state.metrics.read_group_shape()


def wire_stats() -> WireStats:
    """Bytes the installed layer's bucket collectives sent (and the exact ones would
    have) since it was installed; empty without a layer.

    The counters only grow: nobody resets them, so any number of readers can measure
    their own windows, each as the difference of two snapshots
    (``later.since(earlier)``), without changing what the others read.
    """
    layer = INSTALLED.layer
    return WireStats() if layer is None else layer.state.wire.snapshot()


def replica_checks_passed() -> int:
    """How many run-time replica checks (``check_interval``) found every
    data-parallel replica alike so far in this process (a mismatch raises)."""
    layer = INSTALLED.layer
    return 0 if layer is None else layer.state.replica_checks_passed


def kernel_warm_up() -> tuple:
    """(kinds of kernel call compiled, seconds) when DDP was built: the Triton variants
    the collectives will launch, compiled then rather than in the first step; (n, 0.0)
    where the torch reference serves the device (nothing to compile)."""
    layer = INSTALLED.layer
    return (0, 0.0) if layer is None else (len(layer.state.warmed_up), layer.state.warm_up_seconds)


def collective_waits() -> Dict[str, tuple]:
    """``{collective: (seconds, timed waits)}`` this rank's training thread has spent so
    far waiting on the layer's overlapped ``reduce_scatter`` and ``all_gather``: the
    communication megatron's overlap left exposed (``group_handle.WaitClock``; timed on
    gloo's worker thread only, 0 waits elsewhere). Only grows; zeros without a layer."""
    layer = INSTALLED.layer
    return WaitClock().snapshot() if layer is None else layer.state.waits.snapshot()


def collective_plan(model_chunks) -> list:
    """Lines saying where the ranks run (from the hosts) and each data-parallel group's
    reduce-scatter hops on this rank (``hop_plan.py``); empty without a layer. Not
    collective: read after the model's DDP is built."""
    from megatron_sdp4bit.megatron.hop_plan import plan_lines

    layer = INSTALLED.layer
    return [] if layer is None or not layer.state.config.enabled else plan_lines(layer, model_chunks)


def memory(optimizer, params: int):
    """``LayerMemory``: bytes the layer holds across steps and its scratch peak on this
    rank, for ``params`` model parameters here (collective over the DP group)."""
    from megatron_sdp4bit.megatron.memory import optimizer_memory

    return optimizer_memory(INSTALLED.require("memory()"), optimizer, params)


def state_dict(optimizer) -> dict:
    """The layer's part of a checkpoint (see ``SDP4BitLayer.state_dict``)."""
    layer = INSTALLED.layer
    return {} if layer is None else layer.state_dict(optimizer)


def main_shards_refusal(state: dict, optimizer) -> Optional[str]:
    """The line refusing a saved layer ``state`` whose exact fp32 main shards do not fit
    this rank's buckets, or None (also without a layer). Not collective: the resume
    routes agree on it between the ranks before ``load_state_dict``."""
    layer = INSTALLED.layer
    return None if layer is None or not state else layer.main_shards_refusal(state, optimizer)


def load_state_dict(state: dict, optimizer) -> None:
    """Restore what ``state_dict`` saved; raises ``ValueError`` with the line of
    ``main_shards_refusal`` when its main shards do not fit."""
    layer = INSTALLED.layer
    if layer is not None:
        layer.load_state_dict(state, optimizer)


def optimizer_group(optimizer) -> Tuple[int, int]:
    """(this rank's index, size) of the data-parallel group that shards ``optimizer``'s
    state (megatron's distributed optimizer; where chained, its first one's)."""
    adapter = INSTALLED.require("optimizer_group()").adapter
    return adapter.optimizer_group(adapter.sub_optimizers(optimizer)[0])


def after_optimizer_load(optimizer) -> None:
    """What megatron-core's release needs done after its optimizer state was loaded
    (its adapter's ``after_optimizer_load``, for each sub-optimizer)."""
    adapter = INSTALLED.require("after_optimizer_load()").adapter
    for sub_optimizer in adapter.sub_optimizers(optimizer):
        adapter.after_optimizer_load(sub_optimizer)
