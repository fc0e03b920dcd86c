"""Parameter sync: the all-gather of new weights becomes qWD (or qW).

Three of megatron's methods cooperate, all swapped by the layer:

- ``DistributedOptimizer.step_with_ready_grads``: counts steps; for fp32 params,
  whose main weights megatron keeps in the model buffer itself, lets the optimizer
  step the exact main shard (kept aside by the layer) rather than the quantized
  reconstruction every rank shares.
- ``DistributedOptimizer._copy_main_params_to_model_params``: the new fp32 main
  shard goes into the layer's per-bucket buffer of 1/DP the bucket's size instead
  of into the model weights, which qWD needs intact to take its difference against.
- ``_ParamAndGradBucketGroup.start_param_sync``: when a bucket has fresh main
  weights, ``comm.quantized_all_gather_weights`` adds the dequantized differences
  into every shard, the owner's included (sync, or an async handle megatron waits
  on as usual).

Under --overlap-param-gather megatron starts a bucket group's gather only when the
forward pass reaches the group before it, so each gather has one group's forward
work to hide behind, and the first none. With new main weights ready, the layer
instead submits every group's gather to its runner right after the optimizer step,
in the order the forward pass needs them (``prefetch_gathers``), and hands each
handle to megatron when megatron starts that group: the runner keeps the link busy
from the step on, and a slow link's gathers hide behind the whole forward pass.

With one rank in the group nothing is quantized: megatron's own methods run. So do
they for the exact all-gather, except where megatron's coalesced one cannot run
(gloo on CUDA tensors, ``LayerState.own_exact_collectives``): there the layer
gathers each bucket itself. Every gather the layer issues goes to its runner
(``megatron/background.py``): with --overlap-param-gather the whole gather runs
there while the forward pass goes on, until the forward pre-hook waits on it.
"""
from __future__ import annotations

import torch

from megatron_sdp4bit import comm
from megatron_sdp4bit.comm.primitives import all_gather_flat
from megatron_sdp4bit.comm.runner import run_or_submit
from megatron_sdp4bit.megatron import consistency, quant_metrics
from megatron_sdp4bit.megatron.exact_collective_bytes import record_exact
from megatron_sdp4bit.megatron.group_handle import Handles


def _weights_quantized(layer, optimizer) -> bool:
    return layer.state.config.quantize_weights and layer.adapter.optimizer_group(optimizer)[1] > 1


def _check_replicas(layer, optimizer) -> None:
    """Every ``check_interval`` steps: the weights every rank trained on (gathered at
    the end of the previous step, all waited for by the forward pass) must agree."""
    state, adapter = layer.state, layer.adapter
    interval = state.config.check_interval
    if not interval or (state.iteration + 1) % interval:
        return
    if adapter.optimizer_group(optimizer)[1] == 1:
        return
    buffers = [(f"buffer {b} bucket {k}", adapter.bucket_param_data(bucket))
               for (b, k), bucket in adapter.buffer_buckets(optimizer)]
    consistency.check_replicas(buffers, adapter.optimizer_process_group(optimizer), state.iteration)
    state.replica_checks_passed += 1  # check_replicas raises on any difference


def step_with_ready_grads(layer, optimizer) -> bool:
    state, adapter = layer.state, layer.adapter
    if state.config.enabled:  # at its first step: megatron builds it after DDP
        state.refuse_once(adapter, optimizer, getattr(optimizer, "config", None))
    for bucket_group in adapter.gather_order(optimizer):  # one the forward never started
        leftover = state.prefetched.pop(bucket_group, None)
        if leftover is not None:
            leftover.wait()
    _check_replicas(layer, optimizer)
    if _weights_quantized(layer, optimizer):
        rank, size = adapter.optimizer_group(optimizer)
        for bucket in adapter.optimizer_buckets(optimizer):
            model_shard = adapter.param_shard(bucket, size, rank)
            if model_shard.dtype != torch.float32:
                continue
            # fp32 params: megatron's main weights are this very buffer shard. Save the
            # reconstructed weights every rank shares, and let the optimizer step the
            # exact main weights (kept from the previous step) instead.
            kept = state.bucket(bucket)
            kept.reconstructed = model_shard.clone()
            if kept.main_shard is not None and kept.main_shard.numel() == model_shard.numel():
                model_shard.copy_(kept.main_shard)
    state.in_optimizer_step = True
    state.stepping_groups = frozenset(map(id, adapter.gather_order(optimizer)))
    try:
        success = layer.original("optimizer", "step_with_ready_grads")(optimizer)
    finally:
        state.in_optimizer_step = False
        state.stepping_groups = frozenset()
    if not state.chain_depth:  # a chain counts its iteration itself, once
        state.iteration += 1
    # (not on a deferring runner: the gathers' stages would all be issued here, before the
    # forward pass's kernels, in the one hardware queue they share)
    if success and _weights_quantized(layer, optimizer) \
            and adapter.ddp_config(optimizer).overlap_param_gather \
            and state.runner.kind != "deferred":
        prefetch_gathers(layer, optimizer)
    return success


def chained_step_with_ready_grads(layer, chained) -> bool:
    """megatron's chained optimizer (MoE: a dense and an expert member; 0.19 chains a
    dense model's one optimizer too) steps its members one after another: one training
    iteration, counted once when the last member is done, so every member's step sees
    the same iteration (its replica check, error sampling, ``grad_start_iter``)."""
    state = layer.state
    state.chain_depth += 1
    try:
        success = layer.original("chained_optimizer", "step_with_ready_grads")(chained)
    finally:
        state.chain_depth -= 1
    if not state.chain_depth:  # the outermost chain: one iteration
        state.iteration += 1
    return success


def prefetch_gathers(layer, optimizer) -> None:
    """Every bucket group with new main weights: its gather submitted now, in forward
    order, kept until megatron starts it (``start_param_sync`` hands the handle over)."""
    state, adapter = layer.state, layer.adapter
    for bucket_group in adapter.gather_order(optimizer):
        buckets = adapter.group_buckets(bucket_group)
        if bucket_group in state.prefetched or adapter.param_gather_in_flight(bucket_group):
            continue
        if state.all_unsent(buckets):
            state.prefetched[bucket_group] = _quantized_gather(layer, bucket_group, async_op=True)


def copy_main_params_to_model_params(layer, optimizer):
    """Write new fp32 main shards into the layer's per-bucket buffers."""
    state, adapter = layer.state, layer.adapter
    if not (state.in_optimizer_step and _weights_quantized(layer, optimizer)):
        return layer.original("optimizer", "_copy_main_params_to_model_params")(optimizer)
    # refused, if at all, in step_with_ready_grads (in_optimizer_step is set there)
    rank, size = adapter.optimizer_group(optimizer)
    sample = state.metrics.sample_now(state.iteration)
    for bucket in adapter.optimizer_buckets(optimizer):
        model_shard = adapter.param_shard(bucket, size, rank)
        kept = state.bucket(bucket)
        if kept.main_shard is None or kept.main_shard.numel() != model_shard.numel():
            kept.main_shard = torch.empty(model_shard.numel(), dtype=torch.float32,
                                          device=model_shard.device)
        # Padding and anything no main param covers keep the model's value (diff 0).
        kept.main_shard.copy_(model_shard)
        if model_shard.dtype == torch.float32:
            # fp32 params: the optimizer stepped the exact main weights in the buffer
            # itself; they are kept above. Put the shared reconstruction back.
            model_shard.copy_(kept.reconstructed)
        kept.unsent_main_weights = True
        kept.sample_error = sample
    for bucket, start, numel, main_param in adapter.main_param_ranges(optimizer):
        main_shard = state.bucket(bucket).main_shard
        offset = start - rank * main_shard.numel()
        main_shard[offset:offset + numel].copy_(main_param.view(-1))


def _own_exact_param_sync(layer, bucket_group, async_op: bool, force_sync: bool) -> None:
    """Megatron's exact all-gather of each bucket's shard, one bucket at a time through
    ``comm`` (gloo on CUDA, where megatron's coalesced one cannot run)."""
    adapter, runner = layer.adapter, layer.state.runner
    group, size, rank = adapter.collective_group(bucket_group)
    group = runner.group_for(group)
    buffers = adapter.param_buffers(bucket_group)
    record_exact(layer, bucket_group, "all_gather", buffers)
    handles = []
    for param_data in buffers:
        flat = param_data.view(-1)
        shard = flat.numel() // size

        def gather(flat=flat, shard=shard):
            all_gather_flat(flat, flat[rank * shard:(rank + 1) * shard], group, False)

        handles.append(run_or_submit(runner, gather, async_op, (flat,)))
    adapter.set_param_gather_handle(
        bucket_group, Handles(handles, clock=layer.state.wait_clock(), kind="all_gather") if async_op else None,
        force_sync)


def _another_optimizers_group(state, bucket_group, force_sync: bool) -> bool:
    """A sub-optimizer's step starting a bucket group another member of the chain holds:
    that one sends it in its own step (with its fresh weights); sent here it would go
    exact, and twice (megatron-core's ChainedOptimizer, e.g. MoE's dense and expert)."""
    return state.in_optimizer_step and not force_sync and id(bucket_group) not in state.stepping_groups


def start_param_sync(layer, bucket_group, force_sync: bool = False):
    state, adapter = layer.state, layer.adapter
    if _another_optimizers_group(state, bucket_group, force_sync):
        return
    prefetched = state.prefetched.pop(bucket_group, None)
    if prefetched is not None:  # submitted after the optimizer step: megatron takes it now
        if force_sync:
            prefetched.wait()
            adapter.set_param_gather_handle(bucket_group, None, force_sync)
        else:
            adapter.set_param_gather_handle(bucket_group, prefetched, force_sync)
        return
    buckets = adapter.group_buckets(bucket_group)
    quantize = state.config.quantize_weights and state.all_unsent(buckets)
    if not (quantize or state.own_exact_collectives):
        if not (force_sync and adapter.param_gather_in_flight(bucket_group)):
            record_exact(layer, bucket_group, "all_gather", adapter.param_buffers(bucket_group))
        return layer.original("bucket_group", "start_param_sync")(bucket_group, force_sync=force_sync)
    if force_sync and adapter.param_gather_in_flight(bucket_group):
        adapter.finish_pending_param_gather(bucket_group)
        return
    assert not adapter.param_gather_in_flight(bucket_group)
    async_op = bool(adapter.ddp_config(bucket_group).overlap_param_gather) and not force_sync
    if not quantize:
        return _own_exact_param_sync(layer, bucket_group, async_op, force_sync)
    gather = _quantized_gather(layer, bucket_group, async_op)
    if async_op:
        adapter.set_param_gather_handle(bucket_group, gather, force_sync)
    else:
        gather.wait()
        adapter.set_param_gather_handle(bucket_group, None, force_sync)


def _quantized_gather(layer, bucket_group, async_op: bool) -> Handles:
    """The qWD/qW gather of every bucket of the group (fresh main weights), as one handle
    that also samples the weight error where asked when it is waited on."""
    state, adapter = layer.state, layer.adapter
    buckets = adapter.group_buckets(bucket_group)
    group, size, rank = adapter.collective_group(bucket_group)
    kept = [state.bucket(b) for b in buckets]
    handles = []
    for param_data, bucket_state in zip(adapter.param_buffers(bucket_group), kept):
        handles.append(comm.quantized_all_gather_weights(
            param_data, bucket_state.main_shard, group=state.runner.group_for(group),
            config=state.config, async_op=async_op,
            generator=state.generator(bucket_state.main_shard.device, "weights", bucket_group),
            workspace=state.weight_workspace, recorder=state.wire, runner=state.runner))
        bucket_state.unsent_main_weights = False
    first_bucket, first = buckets[0], kept[0]

    def record_weight_error():
        if not first.sample_error:
            return
        first.sample_error = False
        n = min(quant_metrics.SAMPLE, first.main_shard.numel())
        shard = adapter.param_shard(first_bucket, size, rank)
        state.metrics.record({"weight": quant_metrics.relative_error(shard[:n], first.main_shard[:n])})

    return Handles(handles, on_done=record_weight_error, clock=state.wait_clock(), kind="all_gather")
