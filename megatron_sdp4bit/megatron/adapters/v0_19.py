"""megatron-core 0.19: what changed since 0.18 at the layer's seams.

- ``start_grad_sync`` waits for CUDA-graph replays (``param._cudagraph_wgrad_ready_event``)
  before it reads, scales or reduces gradients; the layer's reduce-scatter does too.
- CPU backend: ``MegatronOptimizer.has_grad_norm_group`` (new) allocates its
  flag with a ``device='cuda'`` literal on every optimizer step.
- CPU mode for ``megatron.training`` (shipped in this release's wheel):
  ``cpu_training_sites()`` names what ``cpu_backend/megatron_training.py`` redirects there.
- ``_post_param_sync`` copies gathered slices into MXFP8 parameters with the new
  ``copy_tensor_to_quantized_param`` (``quantized_param_copy()``; the layer refuses
  ``reuse_grad_buf_for_mxfp8_param_ag``, the only path that calls it).
- DDP's ``reset_param_sync_dispatch_state()`` asserts that no parameter all-gather
  is in flight: the layer's gather handle lives where megatron's does
  (``param_gather_handle``) and is cleared when waited, so the check holds.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_sdp4bit.megatron.adapters.cpu_sites import CoreSites, TrainingSites
from megatron_sdp4bit.megatron.adapters.fingerprints import Seam
from megatron_sdp4bit.megatron.adapters.v0_18 import Adapter as Adapter018


class Adapter(Adapter018):
    minor = "0.19"
    tested_versions = ("0.19.2",)
    seams = Adapter018.seams + (
        Seam("megatron.core.optimizer.optimizer:MegatronOptimizer.has_grad_norm_group", "wraps",
             "cpu_backend/core.py"),
        # the chain's member loop moved here from step_with_ready_grads, which the layer
        # wraps to count one iteration for all members
        Seam("megatron.core.optimizer.optimizer:ChainedOptimizer._step", "mirrors",
             "megatron/param_sync.py"),
        # The CPU mode of megatron.training (cpu_backend/megatron_training.py, its numbers).
        *(Seam(name, how, "cpu_backend/megatron_training.py") for name, how in (
            ("megatron.training.initialize:initialize_megatron", "wraps"),
            ("megatron.training.initialize:_initialize_distributed", "wraps"),
            ("megatron.training.initialize:_set_random_seed", "wraps"),
            ("megatron.training.initialize:_warmup_jit_function", "replaces"),
            ("megatron.training.checkpointing:get_rng_state", "wraps"),
            ("megatron.core.rerun_state_machine:RerunStateMachine._save_state", "wraps"),
            ("megatron.core.rerun_state_machine:RerunStateMachine._restore_state", "wraps"),
            ("megatron.training.utils.common_utils:get_device_arch_version", "replaces"),
            ("megatron.training.training:pretrain", "wraps"),
            ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
             "wraps"),
            ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict", "wraps"),
        )),
        Seam("megatron.core.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller.async_loop",
             "wraps", "cpu_backend/checkpoint_worker.py"),
    )

    def before_grad_reduce(self, bucket_group) -> None:
        self._drain_previous_grad_reduce(bucket_group)
        assert bucket_group.grad_reduce_handle is None, (
            "Should not have multiple communication calls outstanding at once")
        self._wait_for_cuda_graph_grads(bucket_group)
        self._copy_extra_main_grads_in(bucket_group)
        self._check_and_scale_grads(bucket_group)

    def _wait_for_cuda_graph_grads(self, bucket_group) -> None:
        waited = set()
        for bucket in bucket_group.buckets:
            for param in bucket.params_list:
                event = getattr(param, "_cudagraph_wgrad_ready_event", None)
                if event is not None and id(event) not in waited:
                    torch.cuda.current_stream().wait_event(event)
                    waited.add(id(event))

    def quantized_param_copy(self):
        import megatron.core.distributed.param_and_grad_buffer as param_and_grad_buffer

        return (param_and_grad_buffer, "copy_tensor_to_quantized_param")

    def cpu_backend_sites(self) -> CoreSites:
        from megatron.core.optimizer.optimizer import MegatronOptimizer

        sites = super().cpu_backend_sites()
        return dataclasses.replace(sites, methods=sites.methods + ((MegatronOptimizer, "has_grad_norm_group"),))

    def cpu_training_sites(self) -> TrainingSites:
        """What the CPU mode of ``megatron.training`` redirects (``cpu_backend/megatron_training.py``)."""
        import megatron.training.arguments as arguments
        import megatron.training.checkpointing as checkpointing
        import megatron.training.initialize as initialize
        import megatron.training.training as training
        from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.rerun_state_machine import RerunStateMachine
        from megatron.training.utils import common_utils

        return TrainingSites(
            initialize_megatron=initialize.initialize_megatron,
            one_device=((initialize, "_initialize_distributed"), (initialize, "_set_random_seed")),
            jit_warmup=(initialize, "_warmup_jit_function"),
            checkpoint_rng=(checkpointing.get_rng_state, checkpointing.load_checkpoint),
            rng_save_restore=((RerunStateMachine, "_save_state"), (RerunStateMachine, "_restore_state")),
            device_arch=common_utils.get_device_arch_version,
            pretrain=training.pretrain,
            optimizer_state_setter=(DistributedOptimizer, "_set_main_param_and_optimizer_states"),
            optimizer_state_dict=(DistributedOptimizer, "state_dict"),
            validate_args=arguments.validate_args,
            checkpoint_worker=(PersistentAsyncCaller, "async_loop"),
        )
