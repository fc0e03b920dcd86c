"""The patch layer: megatron-core's bucket collectives replaced by SDP4Bit's.

``install(config)`` swaps four methods on megatron-core's classes, so every bucket
group of every model chunk (all virtual-pipeline chunks included) is covered:

- ``_ParamAndGradBucketGroup.start_grad_sync``: the reduce-scatter of each bucket's
  ``grad_data`` becomes ``comm.quantized_reduce_scatter`` (TLq-HS, TLq or ULq), with
  megatron's own gradient scaling, reduce op and async handle semantics.
- ``_ParamAndGradBucketGroup.start_param_sync``: the all-gather of each bucket's
  ``param_data`` becomes ``comm.quantized_all_gather_weights`` (qWD or qW), when the
  optimizer has just produced new main weights for that bucket (otherwise the exact
  all-gather runs, which is then a no-op re-broadcast).
- ``DistributedOptimizer._copy_main_params_to_model_params``: instead of writing the
  new fp32 main shard into the model's param buffer (which would destroy the
  previous model shard that qWD takes its difference against), it writes it into
  a per-bucket fp32 *main shard* of 1/DP the bucket's size. The all-gather then
  adds the dequantized difference into every shard, the owner's included.
- ``DistributedOptimizer.step_with_ready_grads``: counts optimizer steps (for
  ``grad_start_iter``) and, for fp32 params, whose main weights are views of the
  model buffer in megatron, puts the exact main shard back into the buffer for the
  optimizer step and the reconstructed one back afterwards.
- ``DistributedDataParallel.__init__``: a collective point every rank reaches, so
  the check that all ranks share the config and the creation of the intra/inter-
  node process groups of every data-parallel group happen there, in the same
  order on all ranks.

``uninstall()`` restores the originals; installing twice replaces the config.
With the config's quantization off, every patched method defers to megatron's own
code, so training is bit-identical to stock megatron-core.

Version knowledge lives in ``megatron_sdp4bit.megatron.compat``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_sdp4bit import comm
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron import compat, quant_metrics

logger = logging.getLogger(__name__)


@dataclass
class _State:
    config: SDP4BitConfig
    originals: dict = field(default_factory=dict)
    iteration: int = 0
    in_optimizer_step: bool = False
    config_checked: bool = False
    quant_errors: dict = field(default_factory=dict)
    grad_errors_sampled_at: int = -1  # one sample per iteration, not one per bucket group


_STATE: Optional[_State] = None


def is_installed() -> bool:
    return _STATE is not None


def current_config() -> Optional[SDP4BitConfig]:
    return None if _STATE is None else _STATE.config


def set_iteration(iteration: int) -> None:
    """Tell the layer how many optimizer steps are done (after loading a checkpoint)."""
    if _STATE is not None:
        _STATE.iteration = int(iteration)


def get_iteration() -> int:
    return 0 if _STATE is None else _STATE.iteration


# --- checks ------------------------------------------------------------------------

def _check_same_config_on_all_ranks(config: SDP4BitConfig) -> None:
    """All ranks must quantize alike; a mismatch raises on every rank (no hang)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([config.fingerprint(), -config.fingerprint()], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    if mine[0].item() != config.fingerprint() or -mine[1].item() != config.fingerprint():
        raise RuntimeError(
            "SDP4Bit configuration differs across ranks; every rank must be launched with the "
            f"same --sdp4bit* flags (this rank: {config.to_dict()})"
        )


def _check_ddp_config(ddp_config) -> None:
    if not ddp_config.use_distributed_optimizer:
        raise RuntimeError(
            "SDP4Bit quantizes the distributed optimizer's reduce-scatter and all-gather: "
            "enable it with --use-distributed-optimizer (DistributedDataParallelConfig("
            "use_distributed_optimizer=True)), or drop the --sdp4bit flags"
        )
    if ddp_config.num_distributed_optimizer_instances > 1:
        raise RuntimeError(
            "SDP4Bit does not support num_distributed_optimizer_instances > 1 yet: "
            "set --num-distributed-optimizer-instances 1, or drop the --sdp4bit flags"
        )
    if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(
        ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False
    ):
        raise RuntimeError("SDP4Bit supports neither Megatron-FSDP nor MXFP8 param all-gathers")


# --- handles -----------------------------------------------------------------------

class _Handles:
    """Waits on several collective handles, like the coalescing manager's handle,
    then runs ``on_done`` once."""

    def __init__(self, handles, on_done=None):
        self.handles = [h for h in handles if h is not None]
        self.on_done = on_done

    def wait(self):
        for handle in self.handles:
            handle.wait()
        self.handles = []
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            on_done()


# --- gradient reduce-scatter ----------------------------------------------------------

def _grads_quantized_now() -> bool:
    cfg = _STATE.config
    return cfg.quantize_grads and _STATE.iteration >= cfg.grad_start_iter


def _record_exact(bucket_group, collective: str, buffers) -> None:
    """Count a collective megatron runs itself, so the wire totals stay complete."""
    from megatron_sdp4bit.comm.accounting import record_call, record_peer_sends
    from megatron_sdp4bit.comm.topology import peer_split

    group = bucket_group.intra_distributed_optimizer_instance_group
    size = bucket_group.intra_distributed_optimizer_instance_size
    same, other = peer_split(group, _STATE.config.ranks_per_node)
    record_call(collective)
    for buffer in buffers:
        shard = buffer.numel() // size
        nbytes = shard * buffer.element_size()
        record_peer_sends(collective, same, other, exact=nbytes, values=nbytes, elements=shard)


def _start_grad_sync(self, force_all_reduce: Optional[bool] = False):
    original = _STATE.originals["start_grad_sync"]
    if not _grads_quantized_now() or force_all_reduce:
        if self.ddp_config.use_distributed_optimizer and not force_all_reduce:
            if not (self.is_first_batch and self.grad_reduce_handle is not None):
                _record_exact(self, "reduce_scatter", [b.grad_data for b in self.buckets])
        return original(self, force_all_reduce=force_all_reduce)
    _check_ddp_config(self.ddp_config)
    if self.is_first_batch and self.grad_reduce_handle is not None:
        return  # already dispatched during the first batch (as megatron does)
    assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
    if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
        self.check_grads(
            check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
            check_for_large=self.ddp_config.check_for_large_grads,
        )
    for bucket in self.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
    if _STATE.grad_errors_sampled_at != _STATE.iteration:
        _STATE.grad_errors_sampled_at = _STATE.iteration
        _STATE.quant_errors.update(
            quant_metrics.grad_quantization_errors(self.buckets[0].grad_data, _STATE.config))
    op = torch.distributed.ReduceOp.AVG if self.ddp_config.average_in_collective else torch.distributed.ReduceOp.SUM
    group = self.intra_distributed_optimizer_instance_group
    size = self.intra_distributed_optimizer_instance_size
    rank = self.intra_distributed_optimizer_instance_rank
    async_op = bool(self.ddp_config.overlap_grad_reduce)
    handles = []
    for bucket in self.buckets:
        shard = bucket.grad_data.numel() // size
        local_view = bucket.grad_data[rank * shard:(rank + 1) * shard]
        handles.append(comm.quantized_reduce_scatter(
            local_view, bucket.grad_data, op=op, group=group, config=_STATE.config, async_op=async_op
        ))
    self.grad_reduce_handle = _Handles(handles) if async_op else None


# --- weight all-gather -----------------------------------------------------------------

def _bucket_shard(bucket, size: int, rank: int) -> torch.Tensor:
    shard = bucket.param_data.numel() // size
    return bucket.param_data[rank * shard:(rank + 1) * shard]


def _start_param_sync(self, force_sync: bool = False):
    original = _STATE.originals["start_param_sync"]
    fresh = all(getattr(b, "_sdp4bit_fresh", False) for b in self.buckets)
    if not _STATE.config.quantize_weights or not fresh:
        if not (force_sync and self.param_gather_handle is not None):
            _record_exact(self, "all_gather", [b.param_data for b in self.buckets])
        return original(self, force_sync=force_sync)
    if force_sync and self.param_gather_handle is not None:
        self.param_gather_handle.wait()
        self.param_gather_handle = None
        return
    assert self.param_gather_handle is None
    async_op = bool(self.ddp_config.overlap_param_gather) and not force_sync
    group = self.intra_distributed_optimizer_instance_group
    handles = []
    for bucket in self.buckets:
        handles.append(comm.quantized_all_gather_weights(
            bucket.param_data, bucket._sdp4bit_main_shard, group=group,
            config=_STATE.config, async_op=async_op,
        ))
        bucket._sdp4bit_fresh = False
    size = self.intra_distributed_optimizer_instance_size
    rank = self.intra_distributed_optimizer_instance_rank
    first = self.buckets[0]

    def record_weight_error():
        n = min(quant_metrics.SAMPLE, first._sdp4bit_main_shard.numel())
        _STATE.quant_errors["weight"] = quant_metrics.relative_error(
            _bucket_shard(first, size, rank)[:n], first._sdp4bit_main_shard[:n])

    gather = _Handles(handles, on_done=record_weight_error)
    if async_op:
        self.param_gather_handle = gather
    else:
        gather.wait()
        self.param_gather_handle = None
    self.param_gather_dispatched = True


def _optimizer_buckets(optimizer):
    for buffer in optimizer.buffers:
        for bucket in buffer.buckets:
            yield bucket


def _local_rank_and_size(optimizer):
    group = optimizer.data_parallel_group
    return group.rank(), group.size()


def _copy_main_params_to_model_params(self):
    """Write new fp32 main shards into per-bucket main-shard buffers (qWD needs the
    previous model shard intact until the all-gather adds the difference)."""
    original = _STATE.originals["copy_main_to_model"]
    if not (_STATE.config.quantize_weights and _STATE.in_optimizer_step):
        return original(self)
    _check_ddp_config(self.ddp_config)
    rank, size = _local_rank_and_size(self)
    for bucket in _optimizer_buckets(self):
        model_shard = _bucket_shard(bucket, size, rank)
        main = getattr(bucket, "_sdp4bit_main_shard", None)
        if main is None or main.numel() != model_shard.numel():
            main = torch.empty(model_shard.numel(), dtype=torch.float32, device=model_shard.device)
            bucket._sdp4bit_main_shard = main
        if model_shard.dtype == torch.float32:
            # fp32 params: the optimizer stepped the exact main weights in the buffer
            # itself. Keep them here and put the reconstructed weights back.
            main.copy_(model_shard)
            model_shard.copy_(bucket._sdp4bit_reconstructed)
        else:
            # Padding and anything no main param covers keep the model's value (diff 0).
            main.copy_(model_shard)
        bucket._sdp4bit_fresh = True

    def write(shard_main_groups, model_groups):
        for shard_main_group, model_group in zip(shard_main_groups, model_groups):
            for shard_main_param, model_param in zip(shard_main_group, model_group):
                world_range = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
                bucket = self.buffers[gbuf_index].buckets[bucket_id]
                offset = world_range.start - rank * bucket._sdp4bit_main_shard.numel()
                bucket._sdp4bit_main_shard[offset:offset + world_range.size].copy_(
                    shard_main_param.view(-1)
                )

    write(self.shard_fp32_from_float16_groups, self.model_float16_groups)


def _step_with_ready_grads(self) -> bool:
    original = _STATE.originals["step_with_ready_grads"]
    weights = _STATE.config.quantize_weights
    if weights:
        rank, size = _local_rank_and_size(self)
        for bucket in _optimizer_buckets(self):
            model_shard = _bucket_shard(bucket, size, rank)
            if model_shard.dtype != torch.float32:
                continue
            # fp32 params: megatron's main weights are this very buffer shard. Save the
            # reconstructed weights every rank shares, and let the optimizer step the
            # exact main weights (kept from the previous step) instead.
            bucket._sdp4bit_reconstructed = model_shard.clone()
            main = getattr(bucket, "_sdp4bit_main_shard", None)
            if main is not None and main.numel() == model_shard.numel():
                model_shard.copy_(main)
    _STATE.in_optimizer_step = True
    try:
        success = original(self)
    finally:
        _STATE.in_optimizer_step = False
    _STATE.iteration += 1
    return success


# --- metrics -------------------------------------------------------------------------

def quantization_errors() -> dict:
    """Latest sampled relative errors: ``weight`` (reconstructed vs exact main shard,
    after the all-gather) and ``grad_intra`` / ``grad_inter`` (each hop's quantizer
    on a slice of the local gradients)."""
    return {} if _STATE is None else dict(_STATE.quant_errors)


# --- DDP construction: the collective set-up point -------------------------------------

def _all_data_parallel_rank_lists(group) -> list:
    """Rank lists of every rank's group, identical on all ranks (a world collective)."""
    mine = torch.distributed.get_process_group_ranks(group)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return sorted({tuple(ranks) for ranks in everyone})


def _ddp_init(self, *args, **kwargs):
    _STATE.originals["ddp_init"](self, *args, **kwargs)
    if not _STATE.config.enabled:
        return
    _check_ddp_config(self.ddp_config)
    if not _STATE.config_checked:
        _check_same_config_on_all_ranks(_STATE.config)
        _STATE.config_checked = True
    for bucket_group in self.bucket_groups:
        group = bucket_group.intra_distributed_optimizer_instance_group
        comm.build_topologies(_all_data_parallel_rank_lists(group), _STATE.config.ranks_per_node)
        break  # all bucket groups of a model chunk share one group


# --- checkpoint state -------------------------------------------------------------------

def state_dict(optimizer) -> dict:
    """What a resume needs beyond megatron's own checkpoint: the step count, this
    rank's quantizer RNG streams and, for fp32 params, the exact main shards (megatron
    saves the reconstructed weights as its main params there)."""
    if _STATE is None:
        return {}
    main_shards = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for b_index, buffer in enumerate(getattr(opt, "buffers", [])):
            for k, bucket in enumerate(buffer.buckets):
                main = getattr(bucket, "_sdp4bit_main_shard", None)
                if main is not None and bucket.param_data.dtype == torch.float32:
                    main_shards[(b_index, k)] = main.clone()
    return {"iteration": _STATE.iteration, "rng": comm.generator_states(),
            "main_shards": main_shards}


def load_state_dict(state: dict, optimizer) -> None:
    if _STATE is None or not state:
        return
    _STATE.iteration = state["iteration"]
    comm.set_generator_states(state["rng"])
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for b_index, buffer in enumerate(getattr(opt, "buffers", [])):
            for k, bucket in enumerate(buffer.buckets):
                saved = state["main_shards"].get((b_index, k))
                if saved is not None:
                    bucket._sdp4bit_main_shard = saved.to(bucket.param_data.device)


# --- install / uninstall -----------------------------------------------------------

def install(config: SDP4BitConfig, force_version: bool = False) -> None:
    """Route megatron-core's bucket collectives through SDP4Bit's (idempotent).

    Call it before the model is wrapped in DistributedDataParallel. Every rank
    must call it: the check that all ranks pass the same config is collective (run
    here when torch.distributed is initialized, else at the first DDP construction).
    """
    global _STATE
    if not isinstance(config, SDP4BitConfig):
        raise TypeError(f"install() takes an SDP4BitConfig, got {type(config).__name__}")
    compat.check_version(force=force_version)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        _check_same_config_on_all_ranks(config)
    if _STATE is not None:
        _STATE.config = config
        _STATE.config_checked = distributed
        return
    bucket_group_cls, optimizer_cls, ddp_cls = compat.patch_targets()
    state = _State(config=config, config_checked=distributed)
    state.originals = {
        "start_grad_sync": bucket_group_cls.start_grad_sync,
        "start_param_sync": bucket_group_cls.start_param_sync,
        "copy_main_to_model": optimizer_cls._copy_main_params_to_model_params,
        "step_with_ready_grads": optimizer_cls.step_with_ready_grads,
        "ddp_init": ddp_cls.__init__,
    }
    bucket_group_cls.start_grad_sync = _start_grad_sync
    bucket_group_cls.start_param_sync = _start_param_sync
    optimizer_cls._copy_main_params_to_model_params = _copy_main_params_to_model_params
    optimizer_cls.step_with_ready_grads = _step_with_ready_grads
    ddp_cls.__init__ = _ddp_init
    _STATE = state
    logger.info("SDP4Bit installed: %s", config.to_dict())


def uninstall() -> None:
    """Restore megatron-core's own methods (safe when not installed)."""
    global _STATE
    if _STATE is None:
        return
    bucket_group_cls, optimizer_cls, ddp_cls = compat.patch_targets()
    ddp_cls.__init__ = _STATE.originals["ddp_init"]
    bucket_group_cls.start_grad_sync = _STATE.originals["start_grad_sync"]
    bucket_group_cls.start_param_sync = _STATE.originals["start_param_sync"]
    optimizer_cls._copy_main_params_to_model_params = _STATE.originals["copy_main_to_model"]
    optimizer_cls.step_with_ready_grads = _STATE.originals["step_with_ready_grads"]
    _STATE = None
