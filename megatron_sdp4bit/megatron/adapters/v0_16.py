"""megatron-core 0.16: the first supported release; later adapters subclass this."""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch

from megatron_sdp4bit.megatron.adapters.base import MegatronAdapter
from megatron_sdp4bit.megatron.adapters.cpu_sites import CoreSites, RngSites
from megatron_sdp4bit.megatron.adapters.fingerprints import Seam
from megatron_sdp4bit.megatron.adapters.route_sites import RouteSites

_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer"
_OPT = "megatron.core.optimizer"
_RANDOM = "megatron.core.tensor_parallel.random"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_TRAINING = "megatron.training"

SEAMS = (
    # The layer: the six swapped methods, and what megatron does around them that the
    # adapter repeats or keeps in step with.
    Seam(f"{_BUFFER}:_ParamAndGradBucketGroup.start_grad_sync", "replaces", "megatron/grad_sync.py"),
    Seam(f"{_BUFFER}:_ParamAndGradBucketGroup.start_param_sync", "replaces", "megatron/param_sync.py"),
    Seam(f"{_DIST_OPT}:DistributedOptimizer._copy_main_params_to_model_params", "replaces",
         "megatron/param_sync.py"),
    Seam(f"{_DIST_OPT}:DistributedOptimizer.step_with_ready_grads", "wraps", "megatron/param_sync.py"),
    Seam("megatron.core.optimizer.optimizer:ChainedOptimizer.step_with_ready_grads", "wraps",
         "megatron/param_sync.py"),
    Seam(f"{_DDP}:DistributedDataParallel.__init__", "wraps", "megatron/layer.py"),
    Seam(f"{_BUFFER}:_ParamAndGradBucketGroup.__init__", "mirrors", "megatron/adapters/v0_16.py"),
    Seam(f"{_BUFFER}:_ParamAndGradBucketGroup.finish_grad_sync", "mirrors", "megatron/adapters/v0_16.py"),
    Seam(f"{_BUFFER}:_ParamAndGradBucketGroup.finish_param_sync", "mirrors", "megatron/adapters/v0_16.py"),
    Seam(f"{_BUFFER}:_ParamAndGradBuffer.__init__", "copies", "megatron/adapters/v0_16.py"),
    Seam(f"{_BUFFER}:shard_buffer", "copies", "megatron/adapters/v0_16.py"),
    # Checkpoints (training/checkpoint/ through the adapter).
    Seam(f"{_DIST_OPT}:DistributedOptimizer.get_parameter_state_dp_reshardable", "wraps",
         "megatron/adapters/v0_16.py"),
    Seam(f"{_DIST_OPT}:DistributedOptimizer.load_parameter_state_from_dp_reshardable", "mirrors",
         "megatron/adapters/v0_16.py"),
    Seam(f"{_DIST_OPT}:DistributedOptimizer.sharded_param_state_dp_reshardable", "copies",
         "training/checkpoint/reshard.py"),
    Seam(f"{_DIST_OPT}:DistributedOptimizer.load_state_dict", "mirrors", "megatron/adapters/v0_16.py"),
    # The CPU backend (cpu_backend/core.py; its docstring says why each).
    Seam(f"{_RANDOM}:_get_cuda_rng_state", "replaces", "cpu_backend/rng.py"),
    Seam(f"{_RANDOM}:_set_cuda_rng_state", "replaces", "cpu_backend/rng.py"),
    Seam(f"{_RANDOM}:CudaRNGStatesTracker.add", "wraps", "cpu_backend/core.py"),
    # its own code runs; the backend drops the warning it logs, matched by its text
    Seam(f"{_RANDOM}:CudaRNGStatesTracker.fork", "mirrors", "cpu_backend/rng.py"),
    Seam(f"{_RANDOM}:model_parallel_cuda_manual_seed", "wraps", "cpu_backend/rng.py"),
    Seam(f"{_DIST_OPT}:DistributedOptimizer.__init__", "wraps", "cpu_backend/core.py"),
    Seam(f"{_OPT}.optimizer:Float16OptimizerWithFloat16Params.__init__", "wraps", "cpu_backend/core.py"),
    Seam(f"{_OPT}.optimizer:FP32Optimizer.__init__", "wraps", "cpu_backend/core.py"),
    Seam(f"{_OPT}.grad_scaler:MegatronGradScaler.__init__", "wraps", "cpu_backend/core.py"),
    Seam(f"{_OPT}.grad_scaler:DynamicGradScaler.__init__", "wraps", "cpu_backend/core.py"),
    Seam(f"{_OPT}.clip_grads:clip_grad_by_total_norm_fp32", "wraps", "cpu_backend/core.py"),
    Seam(f"{_OPT}.clip_grads:get_grad_norm_fp32", "wraps", "cpu_backend/core.py"),
    Seam(f"{_OPT}.clip_grads:count_zeros_fp32", "wraps", "cpu_backend/core.py"),
    Seam(f"{_SCHEDULES}:forward_backward_no_pipelining", "wraps", "cpu_backend/core.py"),
    Seam(f"{_SCHEDULES}:forward_backward_pipelining_with_interleaving", "wraps", "cpu_backend/core.py"),
    Seam(f"{_SCHEDULES}:forward_backward_pipelining_without_interleaving", "wraps", "cpu_backend/core.py"),
    Seam("megatron.core.transformer.utils:get_default_causal_mask", "wraps", "cpu_backend/core.py"),
    Seam("megatron.core.transformer.utils:get_sliding_window_causal_mask", "wraps", "cpu_backend/core.py"),
    Seam("megatron.core.models.common.language_module.language_module:"
         "LanguageModule.setup_embeddings_and_output_layer", "wraps", "cpu_backend/core.py"),
    # The dataset helpers' NumPy twins (data/numpy_dataset_helpers.py) copy the C++.
    Seam("megatron/core/datasets/helpers.cpp:build_sample_idx", "copies", "data/numpy_dataset_helpers.py"),
    Seam("megatron/core/datasets/helpers.cpp:build_blending_indices", "copies", "data/numpy_dataset_helpers.py"),
    Seam("megatron/core/datasets/helpers.cpp:build_exhaustive_blending_indices", "copies",
         "data/numpy_dataset_helpers.py"),
    # The Megatron-LM routes (megatron_lm/). megatron.training is in the wheel from 0.17 on;
    # for 0.16 it comes from a Megatron-LM checkout, and the wheel's fingerprints are absent.
    Seam("megatron.core.datasets.utils:compile_helpers", "replaces", "megatron_lm/dataset_helpers.py"),
    Seam(f"{_TRAINING}.arguments:parse_args", "wraps", "megatron_lm/launcher.py"),
    Seam(f"{_TRAINING}.arguments:validate_args", "wraps",
         "megatron_lm/routes.py, cpu_backend/megatron_training.py"),
    Seam(f"{_TRAINING}.checkpointing:save_checkpoint", "wraps", "megatron_lm/checkpoint.py"),
    Seam(f"{_TRAINING}.checkpointing:load_checkpoint", "wraps",
         "megatron_lm/checkpoint.py, cpu_backend/megatron_training.py"),
    Seam(f"{_TRAINING}.checkpointing:_load_base_checkpoint", "wraps", "megatron_lm/checkpoint.py"),
    Seam(f"{_TRAINING}.training:train", "wraps", "megatron_lm/reporting.py"),
    Seam(f"{_TRAINING}.training:training_log", "wraps", "megatron_lm/reporting.py"),
    Seam(f"{_TRAINING}.utils:print_rank_last", "wraps", "megatron_lm/reporting.py"),
    Seam(f"{_TRAINING}.utils:calc_params_l2_norm", "wraps", "megatron_lm/weight_readers.py"),
)
"""Every megatron function of 0.16 the package wraps, replaces or copies (fingerprinted
per release in ``tests/megatron/megatron_fingerprints.json``)."""


class Adapter(MegatronAdapter):
    minor = "0.16"
    tested_versions = ("0.16.1",)
    seams = SEAMS

    dataset_helpers_module = "megatron.core.datasets.helpers_cpp"
    dataset_helpers_importer = "megatron.core.datasets.helpers"
    dataset_helper_names = ("build_sample_idx_int32", "build_sample_idx_int64",
                            "build_blending_indices", "build_exhaustive_blending_indices")

    # ------------------------------------------------------------------ classes

    def patch_targets(self) -> dict:
        from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        return {"bucket_group": _ParamAndGradBucketGroup, "optimizer": DistributedOptimizer,
                "chained_optimizer": ChainedOptimizer, "ddp": DistributedDataParallel}

    # ------------------------------------------------------------- DDP config

    def unsupported_ddp_features(self, ddp_config) -> List[str]:
        found = []
        if ddp_config.num_distributed_optimizer_instances > 1:
            found.append("num_distributed_optimizer_instances > 1")
        for flag in ("use_megatron_fsdp", "reuse_grad_buf_for_mxfp8_param_ag",
                     "reduce_scatter_with_fp32_accumulation", "fp8_param_gather",
                     "fp4_param_gather"):
            if getattr(ddp_config, flag, False):
                found.append(flag)
        return found

    # -------------------------------------------------------------- bucket fields

    def ddp_config(self, owner):
        return owner.ddp_config

    def group_buckets(self, bucket_group) -> List[Any]:
        return list(bucket_group.buckets)

    def bucket_grad_data(self, bucket) -> torch.Tensor:
        return bucket.grad_data

    def bucket_param_data(self, bucket) -> Optional[torch.Tensor]:
        return bucket.param_data

    # -------------------------------------------------------------- bucket groups

    def collective_group(self, bucket_group) -> Tuple[Any, int, int]:
        return (bucket_group.intra_distributed_optimizer_instance_group,
                bucket_group.intra_distributed_optimizer_instance_size,
                bucket_group.intra_distributed_optimizer_instance_rank)

    def grad_buffers(self, bucket_group) -> List[torch.Tensor]:
        return [self.bucket_grad_data(bucket) for bucket in self.group_buckets(bucket_group)]

    def param_buffers(self, bucket_group) -> List[Optional[torch.Tensor]]:
        return [self.bucket_param_data(bucket) for bucket in self.group_buckets(bucket_group)]

    def ddp_bucket_groups(self, ddp) -> List[Any]:
        return list(ddp.bucket_groups)

    def param_shard(self, bucket, size: int, rank: int) -> torch.Tensor:
        shard = bucket.param_data.numel() // size
        return bucket.param_data[rank * shard:(rank + 1) * shard]

    def grad_sync_already_dispatched(self, bucket_group) -> bool:
        return bucket_group.is_first_batch and bucket_group.grad_reduce_handle is not None

    def before_grad_reduce(self, bucket_group) -> None:
        assert bucket_group.grad_reduce_handle is None, (
            "Should not have multiple communication calls outstanding at once")
        self._check_and_scale_grads(bucket_group)

    def _check_and_scale_grads(self, bucket_group) -> None:
        ddp_config = bucket_group.ddp_config
        if ddp_config.check_for_nan_in_grad or ddp_config.check_for_large_grads:
            bucket_group.check_grads(check_for_nan_or_inf=ddp_config.check_for_nan_in_grad,
                                     check_for_large=ddp_config.check_for_large_grads)
        with torch.no_grad():
            for bucket in bucket_group.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor

    def set_grad_reduce_handle(self, bucket_group, handle) -> None:
        bucket_group.grad_reduce_handle = handle

    def param_gather_in_flight(self, bucket_group) -> bool:
        return bucket_group.param_gather_handle is not None

    def finish_pending_param_gather(self, bucket_group) -> None:
        bucket_group.param_gather_handle.wait()
        bucket_group.param_gather_handle = None

    def set_param_gather_handle(self, bucket_group, handle, force_sync: bool) -> None:
        bucket_group.param_gather_handle = handle
        bucket_group.param_gather_dispatched = True

    # -------------------------------------------------------- distributed optimizer

    def optimizer_buckets(self, optimizer) -> Iterator[Any]:
        for buffer in optimizer.buffers:
            yield from buffer.buckets

    def optimizer_process_group(self, optimizer):
        return optimizer.data_parallel_group

    def optimizer_group(self, optimizer) -> Tuple[int, int]:
        group = self.optimizer_process_group(optimizer)
        return group.rank(), group.size()

    def main_param_ranges(self, optimizer) -> Iterator[Tuple[Any, int, int, torch.Tensor]]:
        for main_group, model_group in zip(optimizer.shard_fp32_from_float16_groups,
                                           optimizer.model_float16_groups):
            for main_param, model_param in zip(main_group, model_group):
                world_range = optimizer._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = optimizer.model_param_gbuf_map[model_param]
                bucket = optimizer.buffers[gbuf_index].buckets[bucket_id]
                yield bucket, world_range.start, world_range.size, main_param

    def sub_optimizers(self, optimizer) -> List[Any]:
        return list(getattr(optimizer, "chained_optimizers", [optimizer]))

    def gather_order(self, optimizer) -> List[Any]:
        # DDP's bucket groups (the objects whose start_param_sync megatron calls) that
        # hold this optimizer's buckets (dense or expert), per model chunk; DDP chains
        # each to the one before it in its list (next_param_gather_bucket_group): the
        # forward pass starts at the last.
        mine = set(map(id, self.optimizer_buckets(optimizer)))
        order = []
        for chunk in getattr(optimizer, "model_chunks", []):
            for groups in (self.ddp_bucket_groups(chunk), self.expert_bucket_groups(chunk)):
                order += [group for group in reversed(groups)
                          if all(id(bucket) in mine for bucket in self.group_buckets(group))]
        return order

    def expert_bucket_groups(self, ddp) -> List[Any]:
        return list(getattr(ddp, "expert_parallel_bucket_groups", []))

    def buffer_buckets(self, optimizer) -> Iterator[Tuple[Tuple[int, int], Any]]:
        for b_index, buffer in enumerate(getattr(optimizer, "buffers", [])):
            for k, bucket in enumerate(buffer.buckets):
                yield (b_index, k), bucket

    # ----------------------------------------------------------------- checkpoints

    def parameter_state_for_save(self, optimizer) -> Optional[dict]:
        """megatron-core's dp_reshardable loader reads a ``padding`` flag per entry that
        its own ``get_parameter_state_dp_reshardable`` does not write; entries are real
        params. Optimizers that are not distributed keep everything in
        ``state_dict()``: None."""
        if not hasattr(optimizer, "get_parameter_state_dp_reshardable"):
            return None
        state = optimizer.get_parameter_state_dp_reshardable()
        for key, per_dtype in state.items():
            if isinstance(key, int):
                for buckets in per_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry.setdefault("padding", False)
        return state

    def load_parameter_state(self, optimizer, param_state: dict) -> None:
        optimizer.load_parameter_state_from_dp_reshardable(param_state)

    def after_optimizer_load(self, optimizer) -> None:
        """``DistributedOptimizer.load_state_dict`` stores one ``step`` tensor object for
        all params of torch's AdamW, which increments it in place once per param: after
        a resume every param but the first would see a wrong bias correction. Give each
        param its own."""
        inner = getattr(optimizer, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            step = state.get("step")
            if torch.is_tensor(step):
                state["step"] = step.clone()

    def saved_param_groups(self, optimizer_state: dict) -> List[dict]:
        """The distributed and mixed-precision optimizers nest torch's state under
        ``"optimizer"``; ``FP32Optimizer``'s is torch's own."""
        return optimizer_state.get("optimizer", optimizer_state)["param_groups"]

    def plain_model_params(self, optimizer) -> Optional[List[list]]:
        """``FP32Optimizer`` steps the model's params; ``Float16OptimizerWithFloat16Params``
        fp32 copies of its 16-bit ones (``fp32_from_float16_groups``, paired with
        ``float16_groups``) and its fp32 params themselves."""
        if hasattr(optimizer, "get_parameter_state_dp_reshardable"):
            return None
        copies = {id(main): param for mains, params in zip(getattr(optimizer, "fp32_from_float16_groups", []),
                                                           getattr(optimizer, "float16_groups", []))
                  for main, param in zip(mains, params)}
        return [[copies.get(id(p), p) for p in group["params"]] for group in optimizer.optimizer.param_groups]

    def load_plain_optimizer_state(self, optimizer, saved: dict, saved_params: List[list]) -> None:
        """torch's state of a plain optimizer (every param whole, by index) cut into this
        rank's shards: megatron's non-parameter state (param groups with the ``step``,
        the grad scaler) through ``load_state_dict``, then, per bucket, each param's
        range of its fp32 main weights and Adam moments through the loader of megatron's
        "dp_reshardable" form (``get_parameter_state_dp_reshardable``'s entries)."""
        inner = saved.get("optimizer", saved)
        copies = saved.get("fp32_from_fp16_params")  # 16-bit params' fp32 weights, in group order
        whole, steps = {}, set()
        for g, (group, params) in enumerate(zip(inner["param_groups"], saved_params)):
            sixteen_bit = iter(copies[g]) if copies is not None else iter(())
            for index, param in zip(group["params"], params):
                state = inner["state"].get(index, {})
                main = next(sixteen_bit) if param.dtype in (torch.float16, torch.bfloat16) else param.detach()
                zeros = torch.zeros(param.numel(), dtype=torch.float32)
                whole[param] = {"param": main.detach().float().reshape(-1),
                                "exp_avg": state.get("exp_avg", zeros).reshape(-1),
                                "exp_avg_sq": state.get("exp_avg_sq", zeros).reshape(-1)}
                steps.add(float(state.get("step", group.get("step", 0))))
        step = max(steps) if steps else 0.0  # one count for all: every param stepped together
        optimizer.load_state_dict({
            "optimizer": {"param_groups": [{**{k: v for k, v in group.items() if k != "params"}, "step": step}
                                           for group in inner["param_groups"]]},
            **({"grad_scaler": saved["grad_scaler"]} if "grad_scaler" in saved else {})})
        entries = {}
        for gbuf_idx, per_dtype in enumerate(optimizer.gbuf_ranges):
            entries[gbuf_idx] = {dtype: [[{**{k: v[r["param"].start:r["param"].end] for k, v in whole[p].items()},
                                           "step": torch.tensor(step), "padding": False}
                                          for p, r in bucket["param_map"].items()] for bucket in buckets]
                                 for dtype, buckets in per_dtype.items()}
        optimizer.load_parameter_state_from_dp_reshardable(entries)

    def bucket_layout(self, optimizer) -> Optional[list]:
        if not hasattr(optimizer, "per_bucket_numel_unpadded"):
            return None
        return [{"dtypes": [str(dtype).replace("torch.", "") for dtype in key],
                 "numel_unpadded": [int(n) for n in numels]}
                for per_dtype in optimizer.per_bucket_numel_unpadded
                for key, numels in per_dtype.items()]

    # ----------------------------------------------------------------- CPU backend

    def cpu_backend_sites(self) -> CoreSites:
        """Every place megatron-core 0.16 names CUDA on the path the CPU backend runs."""
        import megatron.core.fusions.fused_softmax  # noqa: F401  (binds the causal masks)
        from megatron.core import tensor_parallel  # noqa: F401
        from megatron.core.models.common.language_module.language_module import LanguageModule
        from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import random
        from megatron.core.transformer import utils as transformer_utils

        return CoreSites(
            rng=RngSites(module=random, get_state="_get_cuda_rng_state", set_state="_set_cuda_rng_state",
                         tracker=random.CudaRNGStatesTracker, fork_logger=random.__name__,
                         fork_warning="CPU RNG state changed within GPU RNG context",
                         seed_function=random.model_parallel_cuda_manual_seed),
            type_named_inits=(distrib_optimizer.DistributedOptimizer,
                              optimizer.Float16OptimizerWithFloat16Params),
            # The grad scalers' tensors (a loss scale, also a constant 1.0, turns on
            # megatron's Inf/NaN step skipping).
            inits=(optimizer.FP32Optimizer, grad_scaler.MegatronGradScaler, grad_scaler.DynamicGradScaler),
            type_named_functions=(clip_grads.clip_grad_by_total_norm_fp32,),
            functions=(clip_grads.get_grad_norm_fp32, clip_grads.count_zeros_fp32,
                       schedules.forward_backward_no_pipelining,
                       schedules.forward_backward_pipelining_with_interleaving,
                       schedules.forward_backward_pipelining_without_interleaving,
                       transformer_utils.get_default_causal_mask,
                       transformer_utils.get_sliding_window_causal_mask),
            # Pipeline stages with tied embeddings: the last stage's copy of the word
            # embeddings is all-reduced from the first at construction, after
            # ``weight.data.cuda()``.
            methods=((LanguageModule, "setup_embeddings_and_output_layer"),),
        )

    # ------------------------------------------------------------ Megatron-LM routes

    def megatron_lm_sites(self) -> RouteSites:
        """The same names from core_v0.16.1 to core_v0.19.0 (and Megatron-LM main, 0.20.0):
        the wrapped functions and the module globals they call."""
        import megatron.core.datasets.utils as datasets_utils
        import megatron.training.arguments as arguments
        import megatron.training.checkpointing as checkpointing
        import megatron.training.global_vars as global_vars
        import megatron.training.training as training

        return RouteSites(
            compile_helpers=(datasets_utils, "compile_helpers"),
            checkpointing=checkpointing, save_checkpoint=checkpointing.save_checkpoint,
            load_checkpoint=checkpointing.load_checkpoint,
            state_dict_builder="generate_state_dict", base_loader="_load_base_checkpoint",
            checkpoint_formats=("torch", "torch_dist"),
            training=training,
            training_log="training_log", log_printer="print_rank_last", train="train",
            params_norm="calc_params_l2_norm",
            validate_args=arguments.validate_args,
            get_args=global_vars.get_args,
            writers=(global_vars.get_tensorboard_writer, global_vars.get_wandb_writer),
        )
