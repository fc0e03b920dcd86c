"""The one interface between this package and megatron-core's internals.

Everything the package needs to know about a megatron-core release -- which
classes and methods the layer replaces, the fields of bucket groups, buckets and
the distributed optimizer, the work megatron does around its own collectives, the
checkpoint quirks (for ``training/``), the CPU-backend sites (for ``cpu_backend/``,
typed in ``cpu_sites.py``), what the Megatron-LM routes hook in ``megatron.training``
(for ``megatron_lm/``, typed in ``route_sites.py``) and the dataset helpers (for
``data/``) -- is a method
or attribute of a ``MegatronAdapter``. One subclass per supported minor release
lives next to this file (``v0_16.py`` ... ``v0_19.py``), each written as the
difference to the release before it. The rest of the package talks to megatron's
internals only through this interface.

Adding a release = one new module with a subclass of the newest adapter, its
entry in ``adapters/__init__.py`` and its tests (see docs/megatron.md).
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch

from megatron_sdp4bit.megatron.adapters.cpu_sites import CoreSites, TrainingSites
from megatron_sdp4bit.megatron.adapters.fingerprints import Seam
from megatron_sdp4bit.megatron.adapters.route_sites import RouteSites

# Methods the layer swaps: (owner key, attribute name). The owner keys name the
# classes ``patch_targets`` returns.
SWAPPED_METHODS = (
    ("bucket_group", "start_grad_sync"),
    ("bucket_group", "start_param_sync"),
    ("optimizer", "_copy_main_params_to_model_params"),
    ("optimizer", "step_with_ready_grads"),
    ("chained_optimizer", "step_with_ready_grads"),
    ("ddp", "__init__"),
)

# Entry points a later release adds (see "entry points a later release adds" below): the
# base class's answer is "this release has none", which adapters up to 0.19 inherit.
LATER_RELEASE_ENTRY_POINTS = ("param_ready_callback_class", "finish_param_sync_site", "traced_methods",
                              "quantized_param_copy")


class MegatronAdapter:
    """Version-specific access to megatron-core. Subclasses override what changed."""

    minor: str = ""
    """The ``major.minor`` this adapter is for, e.g. ``"0.16"``."""

    tested_versions: Tuple[str, ...] = ()
    """Full versions the test suite runs against (others of the minor are accepted)."""

    seams: Tuple[Seam, ...] = ()
    """Every megatron function of the release the package wraps, replaces or copies, and
    which of its files does (``fingerprints.Seam``). The test of
    ``tests/megatron/megatron_fingerprints.json`` fails, naming the function, where an
    installed release's code of one differs from the fingerprint recorded for it."""

    # ------------------------------------------------------------------ classes

    def patch_targets(self) -> dict:
        """``{"bucket_group": cls, "optimizer": cls, "chained_optimizer": cls, "ddp": cls}``:
        the classes whose methods are swapped (see ``SWAPPED_METHODS``)."""
        raise NotImplementedError

    # ------------------------------------------------------------- DDP config

    def unsupported_ddp_features(self, ddp_config) -> List[str]:
        """Human-readable names of enabled DDP options the layer cannot quantize."""
        raise NotImplementedError

    # -------------------------------------------------------------- bucket fields

    def ddp_config(self, owner):
        """The DistributedDataParallelConfig a DDP chunk, bucket group or distributed
        optimizer was built with."""
        raise NotImplementedError

    def group_buckets(self, bucket_group) -> List[Any]:
        """The buckets of a bucket group, in megatron's order."""
        raise NotImplementedError

    def bucket_grad_data(self, bucket) -> torch.Tensor:
        """A bucket's flat gradient buffer (all data-parallel ranks' shards)."""
        raise NotImplementedError

    def bucket_param_data(self, bucket) -> Optional[torch.Tensor]:
        """A bucket's flat parameter buffer (None where a release has none)."""
        raise NotImplementedError

    # -------------------------------------------------------------- bucket groups

    def collective_group(self, bucket_group) -> Tuple[Any, int, int]:
        """(process group, size, this rank's index) of the group's reduce-scatter."""
        raise NotImplementedError

    def grad_buffers(self, bucket_group) -> List[torch.Tensor]:
        raise NotImplementedError

    def param_buffers(self, bucket_group) -> List[Optional[torch.Tensor]]:
        """Each bucket's ``param_data`` (None where a release has no param buffer)."""
        raise NotImplementedError

    def ddp_bucket_groups(self, ddp) -> List[Any]:
        """The bucket groups of a DDP model chunk whose collectives the layer handles."""
        raise NotImplementedError

    def param_shard(self, bucket, size: int, rank: int) -> torch.Tensor:
        """This rank's 1/size slice of the bucket's param buffer."""
        raise NotImplementedError

    def grad_sync_already_dispatched(self, bucket_group) -> bool:
        """True when megatron would make this ``start_grad_sync`` a no-op."""
        raise NotImplementedError

    def before_grad_reduce(self, bucket_group) -> None:
        """What megatron does to the gradients before its collective, in order:
        waits, copies into the buffer, NaN/large-gradient checks and scaling."""
        raise NotImplementedError

    def set_grad_reduce_handle(self, bucket_group, handle) -> None:
        raise NotImplementedError

    def param_gather_in_flight(self, bucket_group) -> bool:
        raise NotImplementedError

    def finish_pending_param_gather(self, bucket_group) -> None:
        """``start_param_sync(force_sync=True)`` with a gather in flight: wait, and
        whatever megatron runs after a finished gather."""
        raise NotImplementedError

    def set_param_gather_handle(self, bucket_group, handle, force_sync: bool) -> None:
        """Store the gather's handle (None when it already finished) and mark it
        dispatched, plus whatever megatron runs after a synchronous gather."""
        raise NotImplementedError

    # -------------------------------------------------------- distributed optimizer

    def optimizer_buckets(self, optimizer) -> Iterator[Any]:
        raise NotImplementedError

    def optimizer_group(self, optimizer) -> Tuple[int, int]:
        """(this rank's index, size) of the optimizer's data-parallel group."""
        raise NotImplementedError

    def optimizer_process_group(self, optimizer):
        """The process group over which the optimizer's shards are gathered."""
        raise NotImplementedError

    def main_param_ranges(self, optimizer) -> Iterator[Tuple[Any, int, int, torch.Tensor]]:
        """For every bf16/fp16 param's fp32 main shard: (bucket, start of the shard in
        the bucket, its size, the fp32 main tensor)."""
        raise NotImplementedError

    def sub_optimizers(self, optimizer) -> List[Any]:
        """The distributed optimizers inside a (possibly chained) optimizer."""
        raise NotImplementedError

    def expert_bucket_groups(self, ddp) -> List[Any]:
        """A DDP model chunk's bucket groups of expert parameters (their own data-parallel
        group); megatron runs their collectives through the same swapped methods."""
        raise NotImplementedError

    def gather_order(self, optimizer) -> List[Any]:
        """The bucket groups of a distributed optimizer's model chunks in the order the
        forward pass needs their weights (the order megatron's forward pre-hooks start
        their gathers under --overlap-param-gather)."""
        raise NotImplementedError

    def buffer_buckets(self, optimizer) -> Iterator[Tuple[Tuple[int, int], Any]]:
        """((buffer index, bucket index), bucket) for a distributed optimizer."""
        raise NotImplementedError

    # ----------------------------------------------------------------- checkpoints

    def parameter_state_for_save(self, optimizer) -> Optional[dict]:
        """This rank's shards in megatron's "dp_reshardable" form, loadable again."""
        raise NotImplementedError

    def load_parameter_state(self, optimizer, param_state: dict) -> None:
        """Restore shards in the form ``parameter_state_for_save`` returned (or that form
        cut for another data-parallel size: ``training/checkpoint/reshard.py``)."""
        raise NotImplementedError

    def after_optimizer_load(self, optimizer) -> None:
        """Fix-ups megatron needs after ``load_state_dict`` to continue the same run."""
        raise NotImplementedError

    def plain_model_params(self, optimizer) -> Optional[List[list]]:
        """The model params a non-distributed optimizer steps, per param group, in the
        order of its ``state_dict``'s indices; None for a distributed optimizer."""
        raise NotImplementedError

    def load_plain_optimizer_state(self, optimizer, saved: dict, saved_params: List[list]) -> None:
        """Load into a distributed optimizer the ``state_dict()`` of a non-distributed one
        (``saved``), whose indices stand for ``saved_params`` (this run's model params,
        per param group): every param's fp32 main weights, Adam moments and step, cut
        into this rank's shards."""
        raise NotImplementedError

    def saved_param_groups(self, optimizer_state: dict) -> List[dict]:
        """The param groups (hyper-parameters, no tensors) inside a state an optimizer's
        ``state_dict()`` returned, as the very dicts ``load_state_dict`` will read."""
        raise NotImplementedError

    def bucket_layout(self, optimizer) -> Optional[list]:
        """Per param buffer: its ``[param dtype, grad dtype]`` names and each bucket's
        element count without the end padding (which depends on the data-parallel
        size), JSON-ready. Two runs with equal layouts can exchange optimizer state
        whatever their data-parallel sizes. None for a non-distributed optimizer."""
        raise NotImplementedError

    # ----------------------------------------------------------------- CPU backend

    def cpu_backend_sites(self) -> CoreSites:
        """What the CPU backend redirects in this release (``cpu_backend/core.py``)."""
        raise NotImplementedError

    def cpu_training_sites(self) -> Optional[TrainingSites]:
        """What the CPU mode redirects in ``megatron.training``
        (``cpu_backend/megatron_training.py``); None where that is not worked out for the
        release (then CPU training is refused, changing nothing)."""
        return None

    # ------------------------------------------------------------ Megatron-LM routes

    def megatron_lm_sites(self) -> RouteSites:
        """What the Megatron-LM routes hook in ``megatron.training`` (``megatron_lm/``);
        imports ``megatron.training``, so only where Megatron-LM is importable."""
        raise NotImplementedError

    # ------------------------------------------ entry points a later release adds
    # Megatron-LM main (0.20.0 in package_info.py, not released) adds or renames these at
    # the layer's seams. Each has its place here, filled with what releases up to 0.19
    # have, so that the 0.20 adapter is one module that overrides them. Nothing of the
    # layer calls them before that adapter exists: no support for 0.20 is claimed
    # (docs/megatron.md, "Ready for 0.20").

    def param_ready_callback_class(self) -> Optional[type]:
        """The callable DDP stores on every parameter to publish its bucket group's weights
        on demand (``megatron.core.utils.ensure_params_ready``). Calling it may START a
        parameter all-gather that was never dispatched, outside the forward pre-hook (0.20:
        ``distributed_data_parallel._BucketParamReadyCallback``). None: the release has none."""
        return None

    def finish_param_sync_site(self) -> Optional[Tuple[Any, str]]:
        """DDP's own method that finishes one bucket group's all-gather before its weights
        are read (0.20: ``DistributedDataParallel._finish_param_sync_for_bucket_group``,
        called by the forward pre-hook and the ready callback). None: the pre-hook calls the
        bucket group's ``finish_param_sync`` itself (0.16 to 0.19)."""
        return None

    def traced_methods(self) -> Tuple[Tuple[Any, str], ...]:
        """Methods megatron wraps in a tracing decorator (0.20: DDP's ``start_grad_sync``
        and ``finish_grad_sync``, ``_otel_trace_fn``): the function on the class is the
        decorator's, not the method's, so a swap of one must keep the decorator outside it
        and compare identities under ``__wrapped__``. Empty: none (0.16 to 0.19)."""
        return ()

    def quantized_param_copy(self) -> Optional[Tuple[Any, str]]:
        """The function megatron's ``_post_param_sync`` copies an all-gathered slice into an
        FP8/MXFP8 parameter with (``reuse_grad_buf_for_mxfp8_param_ag``, which the layer
        refuses): 0.19 ``copy_tensor_to_quantized_param(param, slice)``, 0.20 the batched
        ``copy_tensors_to_quantized_params(params, slices)``. None: the release has none."""
        return None

    # ------------------------------------------------------------ dataset helpers

    dataset_helpers_module: str = ""
    """Module name of megatron's compiled dataset helpers."""

    dataset_helper_names: Tuple[str, ...] = ()
    """Functions of that module that ``data/numpy_dataset_helpers.py`` has NumPy twins of."""

    dataset_helpers_importer: str = ""
    """The Python module that copies those functions from the compiled one at import."""
