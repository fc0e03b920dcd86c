"""megatron-core 0.18: what changed since 0.17 at the layer's seams.

- ``_post_param_sync()`` runs after a finished parameter all-gather: from
  ``start_param_sync(force_sync=True)`` (after waiting on an in-flight gather, and
  at the end when ``overlap_param_gather``), from ``finish_param_sync`` and from
  DDP's ``_start_bucket_group_param_sync``. The layer's gather calls it where
  megatron's does.
- ``step_with_ready_grads`` syncs through ``start_param_sync_for_bucket_group_subset()``
  -> ``DDP._start_bucket_group_param_sync`` -> ``start_param_sync``: still the
  swapped method, nothing else to do.
- ``finish_grad_sync`` is idempotent per iteration (``grad_reduce_finished``); a
  bucket group may drain its predecessor's reduce-scatter before starting its own
  (linked only with ``reduce_scatter_with_fp32_accumulation``, which the layer
  refuses; mirrored anyway).
- Buffer layout and padding moved to ``optimizer/param_layout.py``
  (``DistributedOptimizer.compute_full_param_layout`` -> ``DDP(full_param_layout=)``).
  The layer needs no alignment of its own: ``comm`` pads each shard to its group
  sizes internally, so megatron's layout is used as it is.
"""
from __future__ import annotations

from megatron_sdp4bit.megatron.adapters.fingerprints import Seam
from megatron_sdp4bit.megatron.adapters.v0_17 import Adapter as Adapter017

_MOVED = ("megatron.training.utils:print_rank_last", "megatron.training.utils:calc_params_l2_norm")
"""Seams of 0.17 whose functions moved to ``megatron/training/utils/common_utils.py``."""


class Adapter(Adapter017):
    minor = "0.18"
    tested_versions = ("0.18.2",)
    # megatron/training/utils.py became a package (utils/common_utils.py).
    seams = tuple(seam for seam in Adapter017.seams if seam.name not in _MOVED) + (
        Seam("megatron.training.utils.common_utils:print_rank_last", "wraps", "megatron_lm/reporting.py"),
        Seam("megatron.training.utils.common_utils:calc_params_l2_norm", "wraps",
             "megatron_lm/weight_readers.py"),
        Seam("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup._post_param_sync",
             "mirrors", "megatron/adapters/v0_18.py"),
    )

    def before_grad_reduce(self, bucket_group) -> None:
        self._drain_previous_grad_reduce(bucket_group)
        super().before_grad_reduce(bucket_group)

    def _drain_previous_grad_reduce(self, bucket_group) -> None:
        previous = getattr(bucket_group, "previous_grad_reduce_bucket_group", None)
        if previous is not None and previous.grad_reduce_handle is not None:
            previous.finish_grad_sync()

    def finish_pending_param_gather(self, bucket_group) -> None:
        super().finish_pending_param_gather(bucket_group)
        bucket_group._post_param_sync()

    def set_param_gather_handle(self, bucket_group, handle, force_sync: bool) -> None:
        super().set_param_gather_handle(bucket_group, handle, force_sync)
        if force_sync and bucket_group.ddp_config.overlap_param_gather:
            bucket_group._post_param_sync()
