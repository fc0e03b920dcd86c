"""Gradient sync: each bucket's reduce-scatter becomes SDP4Bit's quantized one.

Replaces ``_ParamAndGradBucketGroup.start_grad_sync``. Megatron's own method runs
whenever nothing is quantized (quantization off, before ``grad_start_iter``, a
forced all-reduce, or a one-rank group, where a reduce-scatter is a copy), except
where its collectives cannot run: on gloo with CUDA tensors
(``LayerState.own_exact_collectives``) megatron's coalesced reduce-scatter is not
staged through host memory, so the layer issues the exact one per bucket itself,
through ``comm``. It does the same where the config asks for the exact reduce-scatter
as an all-to-all (``exact_reduce_scatter="alltoall"``). The version-specific work
megatron does before its collective comes from the adapter.

Every collective the layer issues goes to its runner (``megatron/background.py``):
with --overlap-grad-reduce the whole reduce-scatter runs there while the backward
pass goes on, and megatron's ``finish_grad_sync`` waits on its handle.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_sdp4bit import comm
from megatron_sdp4bit.comm.primitives import all_reduce_flat
from megatron_sdp4bit.comm.runner import run_or_submit
from megatron_sdp4bit.megatron import quant_metrics
from megatron_sdp4bit.megatron.exact_collective_bytes import record_exact
from megatron_sdp4bit.megatron.group_handle import Handles


def _megatrons_own_grad_sync(layer, bucket_group, force_all_reduce):
    adapter = layer.adapter
    ddp_config = adapter.ddp_config(bucket_group)
    if (ddp_config.use_distributed_optimizer and not force_all_reduce
            and not adapter.grad_sync_already_dispatched(bucket_group)):
        record_exact(layer, bucket_group, "reduce_scatter", adapter.grad_buffers(bucket_group))
    return layer.original("bucket_group", "start_grad_sync")(
        bucket_group, force_all_reduce=force_all_reduce)


def _exact_is_the_layers(state, size: int) -> bool:
    """The exact reduce-scatter goes through ``comm`` rather than megatron: where
    megatron's coalesced one cannot run (gloo on CUDA), or as the all-to-all the config
    asks for (``exact_reduce_scatter``; a one-rank group has nothing to send)."""
    return state.own_exact_collectives or (size > 1 and state.config.exact_reduce_scatter == "alltoall")


def start_grad_sync(layer, bucket_group, force_all_reduce: Optional[bool] = False):
    state, adapter = layer.state, layer.adapter
    quantize = state.grads_quantized_now() and not force_all_reduce
    if not adapter.ddp_config(bucket_group).use_distributed_optimizer:
        # megatron all-reduces (its bucket group has no reduce-scatter group to ask for)
        if quantize:
            state.refuse_once(adapter, bucket_group)  # refuses, naming the flag
        return _megatrons_own_grad_sync(layer, bucket_group, force_all_reduce)
    group, size, rank = adapter.collective_group(bucket_group)
    if not (quantize and size > 1) and not _exact_is_the_layers(state, size):
        return _megatrons_own_grad_sync(layer, bucket_group, force_all_reduce)
    state.refuse_once(adapter, bucket_group)  # checked at DDP construction, unless reinstalled
    if adapter.grad_sync_already_dispatched(bucket_group):
        return  # already dispatched during the first batch (as megatron does)
    adapter.before_grad_reduce(bucket_group)
    grads = adapter.grad_buffers(bucket_group)
    runner, group = state.runner, state.runner.group_for(group)
    if quantize and state.metrics.sample_now(state.iteration) \
            and state.grad_errors_sampled_at != state.iteration:
        state.grad_errors_sampled_at = state.iteration
        # the hops that run (the topology was built at DDP construction: no collective here)
        hops = comm.get_topology(group, state.config.ranks_per_node).levels
        state.metrics.record(quant_metrics.grad_quantization_errors(
            grads[0], state.config, [hop.name for hop in hops]))
    if quantize and state.metrics.sample_now(state.iteration):
        for grad_data in grads:  # every bucket group's: the sample spans the whole model
            limit = state.sample_limit(quant_metrics.GROUP_SAMPLE, grad_data.numel())
            state.metrics.record_group_shape(
                quant_metrics.gradient_group_shape(grad_data, state.config, limit),
                state.iteration)
    ddp_config = adapter.ddp_config(bucket_group)
    op = torch.distributed.ReduceOp.AVG if ddp_config.average_in_collective else torch.distributed.ReduceOp.SUM
    async_op = bool(ddp_config.overlap_grad_reduce)
    config = state.config if quantize else state.exact_config
    handles = []
    for grad_data in grads:
        if force_all_reduce:  # the layer's own exact path only (megatron's does this otherwise)
            handles.append(run_or_submit(
                runner, lambda data=grad_data: all_reduce_flat(data, op, group, False), async_op,
                (grad_data,)))
            continue
        shard = grad_data.numel() // size
        local_view = grad_data[rank * shard:(rank + 1) * shard]
        handles.append(comm.quantized_reduce_scatter(
            local_view, grad_data, op=op, group=group, config=config, async_op=async_op,
            generator=state.generator(grad_data.device, "grads", bucket_group) if quantize else None,
            workspace=state.grad_workspace, recorder=state.wire, runner=runner))
    handle = Handles(handles, clock=state.wait_clock(), kind="reduce_scatter") if async_op else None
    adapter.set_grad_reduce_handle(bucket_group, handle)
