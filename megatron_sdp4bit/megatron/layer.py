"""The installed patch layer: its state, its adapter, and the methods it swaps.

``SDP4BitLayer.install()`` puts five replacements onto megatron-core's classes
(see ``adapters.base.SWAPPED_METHODS``) through ``megatron_sdp4bit.patching``, which
puts megatron's own back on ``uninstall()``; each is a thin function that hands the
call, with this layer, to the module of its concern:

- gradient sync (``grad_sync.py``): ``start_grad_sync``;
- parameter sync (``param_sync.py``): ``start_param_sync``,
  ``_copy_main_params_to_model_params``, ``step_with_ready_grads``;
- set-up (here): ``DistributedDataParallel.__init__``, the one point every rank
  reaches in the same order, where the config agreement check and the
  intra/inter-node groups of every data-parallel group are made.

The swapped methods hold their layer (a closure); which layer is installed is
``installed.INSTALLED``'s record, kept by ``patch.py``.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from megatron_sdp4bit import comm, quant
from megatron_sdp4bit.comm.connect import connect
from megatron_sdp4bit.comm.kernel_specs import alignment_offset, all_gather_specs, reduce_scatter_specs
from megatron_sdp4bit.comm.layout import whole_bucket
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron import grad_sync, main_shards, param_sync
from megatron_sdp4bit.megatron.background import set_up_runner
from megatron_sdp4bit.comm.primitives import all_gather_flat, runs_on_host_staged_gloo
from megatron_sdp4bit.megatron.config_refusals import (
    check_ddp_for,
    check_host_staged_ddp,
    check_model_config,
    check_same_config_on_all_ranks,
)
from megatron_sdp4bit.megatron.state import LayerState
from megatron_sdp4bit.patching import Patches

logger = logging.getLogger(__name__)


def _all_data_parallel_rank_lists(groups) -> list:
    """For each position i, the rank lists of every rank's i-th group, identical on all
    ranks: one world collective. A rank with fewer groups (a pipeline stage without
    expert layers has no expert bucket groups) adds none at i, so every rank gets the
    same lists and makes the same world collectives with them, whatever it holds."""
    mine = [tuple(torch.distributed.get_process_group_ranks(group)) for group in groups]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    count = max(len(lists) for lists in everyone)
    return [sorted({lists[i] for lists in everyone if i < len(lists)}) for i in range(count)]


class SDP4BitLayer:
    def __init__(self, config: SDP4BitConfig, adapter):
        self.adapter = adapter
        self.state = LayerState(config=config)
        self._patches = Patches("SDP4Bit", f"the megatron-core {adapter.minor} adapter does not fit "
                                "the installed release")
        self._originals: dict = {}
        """megatron's methods the swapped ones call, by (owner key, name)."""

    # ---------------------------------------------------------------- swapping

    def original(self, owner: str, name: str):
        return self._originals[(owner, name)]

    def _bound(self, function):
        layer = self

        def method(megatron_self, *args, **kwargs):
            return function(layer, megatron_self, *args, **kwargs)

        method.__name__ = function.__name__
        method.__qualname__ = f"SDP4BitLayer.{function.__name__}"
        return method

    def install(self) -> None:
        """Put the swapped methods onto megatron's classes (``adapter.patch_targets()``)."""
        targets = self.adapter.patch_targets()
        swaps = {
            ("bucket_group", "start_grad_sync"): grad_sync.start_grad_sync,
            ("bucket_group", "start_param_sync"): param_sync.start_param_sync,
            ("optimizer", "_copy_main_params_to_model_params"): param_sync.copy_main_params_to_model_params,
            ("optimizer", "step_with_ready_grads"): param_sync.step_with_ready_grads,
            ("chained_optimizer", "step_with_ready_grads"): param_sync.chained_step_with_ready_grads,
            ("ddp", "__init__"): _ddp_init,
        }
        try:
            for (owner, name), function in swaps.items():
                self._originals[(owner, name)] = self._patches.set(targets[owner], name, self._bound(function))
        except BaseException:
            self.uninstall()
            raise
        # debug: one line per rank; the Megatron-LM routes print it once, from rank 0
        # (megatron_lm/reporting.py).
        logger.debug("SDP4Bit installed (megatron-core %s adapter): %s",
                    self.adapter.minor, self.state.config.to_dict())

    @property
    def is_installed(self) -> bool:
        return bool(self._originals)

    def uninstall(self) -> None:
        """Put megatron's own methods back and stop the layer's runner (what it was given
        runs first)."""
        self._patches.restore()
        self._originals = {}
        self.state.runner.close()

    # -------------------------------------------------------------- checkpoints

    def state_dict(self, optimizer) -> dict:
        """What a resume needs beyond megatron's own checkpoint: the step count, this
        rank's quantizer RNG streams and, for fp32 params, the exact main shards
        (megatron saves the reconstructed weights as its main params there), keyed by
        their bucket's place in the optimizer chain (``main_shards.py``)."""
        self.state.runner.drain()  # its collectives advance the streams read below
        shards = {}
        for key, _, bucket in main_shards.chain_buckets(self.adapter, optimizer):
            kept = self.state.buckets.get(bucket)
            if kept is not None and kept.main_shard is not None \
                    and self.adapter.bucket_param_data(bucket).dtype == torch.float32:
                shards[key] = kept.main_shard.clone()
        return {"iteration": self.state.iteration, "rng": self.state.rounding_streams.states(),
                "main_shards": shards}

    def main_shards_refusal(self, saved: dict, optimizer) -> Optional[str]:
        """The line refusing ``saved``'s exact main shards for this rank (they do not fit
        its buckets), or None. The resume routes ask it on every rank and agree on the
        answer before the layer takes any state, so that all act on one outcome;
        ``load_state_dict`` asks again for callers that did not."""
        return self._saved_main_shards(saved, optimizer)[2]

    def _saved_main_shards(self, saved: dict, optimizer) -> Tuple[dict, list, Optional[str]]:
        """(the shards under this rank's keys, the buckets whose shard an older save
        replaced, the refusal or None): ``main_shards.py``."""
        buckets = main_shards.fp32_buckets(self.adapter, optimizer)
        shards, replaced = main_shards.under_current_keys((saved or {}).get("main_shards") or {}, buckets)
        return shards, replaced, main_shards.misfit(shards, buckets)

    def load_state_dict(self, saved: dict, optimizer) -> None:
        if not saved:
            return
        shards, replaced, refusal = self._saved_main_shards(saved, optimizer)
        if refusal is not None:
            raise ValueError(f"SDP4Bit state: {refusal}")
        if replaced:
            logger.warning("SDP4Bit: this checkpoint was saved by an older release that kept one exact fp32 "
                           "main shard per (buffer, bucket) for megatron's whole optimizer chain: %d "
                           "bucket(s) (optimizer, buffer, bucket) %s continue from the reconstructed weights "
                           "megatron saved, identical on every rank, not from their exact main weights",
                           len(replaced), replaced)
        self.state.runner.drain()
        self.state.iteration = saved["iteration"]
        # under this run's seed: another --sdp4bit-seed on resume continues the saved streams
        self.state.rounding_streams.set_states(saved["rng"], seed=self.state.config.seed)
        for key, opt, bucket in main_shards.chain_buckets(self.adapter, optimizer):
            main = shards.get(key)
            if main is None:
                continue
            # Asked here, not per optimizer: megatron's optimizers that are not
            # distributed (a plain run) have no data-parallel group, and no shards.
            rank, size = self.adapter.optimizer_group(opt)
            group = self.adapter.optimizer_process_group(opt)
            params = self.adapter.bucket_param_data(bucket)
            main = main.to(params.device)
            if self.state.config.quantize_weights and size > 1:
                self.state.bucket(bucket).main_shard = main  # qWD's next difference
            else:  # nothing will gather differences: the weights are the exact ones
                _put_exact_weights(self.adapter.param_shard(bucket, size, rank), main,
                                   params, group, size)


def _put_exact_weights(own, main, params, group, size: int) -> None:
    """A qWD run with fp32 params saved the reconstructed weights as megatron's (its main
    weights are the param buffer) and the exact ones beside them: resumed without weight
    quantization, each rank writes its exact shard back and every rank gathers them all,
    so training continues from the exact weights on identical replicas."""
    own.copy_(main)  # of the shard's size: ``main_shards.misfit``
    if size > 1:
        flat = params.view(-1)
        all_gather_flat(flat, own.contiguous().clone(), group, async_op=False)


def _megatron_collectives_cannot_run(adapter, ddp) -> bool:
    """gloo on CUDA tensors: megatron's coalesced bucket collectives are not staged
    through host memory there (``comm/primitives.py``); the layer issues them instead."""
    for bucket_group in adapter.ddp_bucket_groups(ddp):
        device = adapter.grad_buffers(bucket_group)[0].device
        # megatron makes every group with the world's backend
        return runs_on_host_staged_gloo(torch.distributed.group.WORLD, device)
    return False


def _collective_groups(adapter, ddp) -> list:
    """The distinct process groups of a model chunk's bucket groups (the experts' too),
    in their order."""
    groups = []
    for bucket_group in adapter.ddp_bucket_groups(ddp) + adapter.expert_bucket_groups(ddp):
        group, size, _rank = adapter.collective_group(bucket_group)
        if size > 1 and all(group is not known for known in groups):
            groups.append(group)
    return groups


def _ddp_init(layer, ddp, *args, **kwargs):
    layer.original("ddp", "__init__")(ddp, *args, **kwargs)
    state, adapter = layer.state, layer.adapter
    if _megatron_collectives_cannot_run(adapter, ddp):
        check_host_staged_ddp(adapter.ddp_config(ddp))
        state.own_exact_collectives = True
    check_ddp_for(state.config, adapter, adapter.ddp_config(ddp))
    if state.config.enabled:
        check_model_config(ddp.config)
        if not state.config_checked:
            state.resolve_ranks_per_node()
            check_same_config_on_all_ranks(state.config)
            state.config_checked = True
    bucket_groups = adapter.ddp_bucket_groups(ddp) + adapter.expert_bucket_groups(ddp)
    state.name_streams(bucket_groups)
    for bucket_group in bucket_groups:
        state.refusals_passed[bucket_group] = state.config  # the steps need not check again
        # what a sampled step samples; only an enabled layer samples, and only under the
        # distributed optimizer (which check_ddp_for requires of it) does a bucket group
        # carry its collective group
        if state.config.enabled and adapter.collective_group(bucket_group)[1] > 1:
            state.grad_elements[bucket_group] = sum(g.numel()
                                                    for g in adapter.grad_buffers(bucket_group))
    issues_collectives = (state.config.enabled or state.own_exact_collectives
                          or state.config.exact_reduce_scatter == "alltoall")
    if not issues_collectives:
        return
    groups = _collective_groups(adapter, ddp)
    rank_lists = _all_data_parallel_rank_lists(groups)
    if state.config.enabled:
        for lists in rank_lists:
            # strict: a DP or expert-DP group spread unevenly over the nodes is refused
            # here, naming its hosts, not served with one flat level
            comm.build_topologies(lists, state.config.ranks_per_node, strict=True)
    set_up_runner(state, adapter, ddp, groups, rank_lists)
    if state.config.enabled:
        _connect_groups(layer, ddp)
        _warm_up_kernels(layer, ddp)


def _connect_groups(layer, ddp) -> None:
    """The first collectives of the groups this model chunk's quantized collectives use
    (a thread runner's private twins), here on every rank in bucket-group order, not
    inside the first backward pass, where NCCL would set them up (``comm/connect.py``)."""
    state, adapter = layer.state, layer.adapter
    for bucket_group in adapter.ddp_bucket_groups(ddp) + adapter.expert_bucket_groups(ddp):
        group, size, _rank = adapter.collective_group(bucket_group)
        buckets = adapter.group_buckets(bucket_group)
        if size == 1 or not buckets:
            continue
        topology = comm.get_topology(state.runner.group_for(group), state.config.ranks_per_node)
        connect(topology, adapter.bucket_grad_data(buckets[0]).device, state.connected_groups)


def say_if_cuda_runs_reference(state, device) -> None:
    """One WARNING where the collectives' tensors are on CUDA but the quantization would
    run the torch reference (``quant.cuda_runs_reference``): it reads a value back to the
    host in every quantization, so each waits for the GPU, and nothing overlaps."""
    if (device is None or torch.device(device).type != "cuda" or state.reference_on_cuda_said
            or not quant.cuda_runs_reference()):
        return
    state.reference_on_cuda_said = True
    logger.warning("SDP4Bit: the quantization runs the torch reference on CUDA (Triton is not "
                   "importable, or SDP4BIT_QUANT_BACKEND=torch): every quantization waits for "
                   "the GPU, so the quantized collectives do not overlap the passes and steps "
                   "are slower; install Triton (torch's CUDA wheels ship it) or unset "
                   "SDP4BIT_QUANT_BACKEND")


def _warm_up_kernels(layer, ddp) -> None:
    """Compile now, not in the first step, the kernels this model chunk's collectives
    will launch (``comm/kernel_specs.py``); nothing to do where the reference serves."""
    state, adapter, config = layer.state, layer.adapter, layer.state.config
    specs, device = [], None
    whole = state.runner.whole_bucket_elements  # the runner's chunks, as the calls make them
    # the experts' bucket groups too: their expert-data-parallel group has other hops
    # (and shards) than the dense one, so other variants
    for bucket_group in adapter.ddp_bucket_groups(ddp) + adapter.expert_bucket_groups(ddp):
        group, size, rank = adapter.collective_group(bucket_group)
        if size == 1:
            continue
        # the group the collectives will use (a thread runner's private twin), built now
        # on every rank: its first topology is a collective over it
        topology = comm.get_topology(state.runner.group_for(group), config.ranks_per_node)
        levels = [(level.name, level.size) for level in topology.levels]
        ddp_config = adapter.ddp_config(bucket_group)
        for bucket in adapter.group_buckets(bucket_group):
            grads, params = adapter.bucket_grad_data(bucket), adapter.bucket_param_data(bucket)
            device = grads.device
            shard = grads.numel() // size
            # where the real calls' views start: the bucket, and this rank's shard of it
            specs += reduce_scatter_specs(
                shard, grads.dtype, levels, config,
                average=bool(ddp_config.average_in_collective),
                ordered=topology.send_order_index(device) is not None,
                input_offset=alignment_offset(grads),
                output_offset=alignment_offset(grads, rank * shard),
                whole=whole_bucket(grads.numel(), whole))
            if params is not None:
                specs += all_gather_specs(params.numel() // size, size, params.dtype, config, rank=rank,
                                          buffer_offset=alignment_offset(params),
                                          whole=whole_bucket(params.numel(), whole))
    say_if_cuda_runs_reference(state, device)
    new = [spec for spec in dict.fromkeys(specs) if spec not in state.warmed_up]
    if not new:
        return
    seconds = quant.warm_up(new, device)
    state.warmed_up.update(new)
    state.warm_up_seconds += seconds
    if seconds:
        logger.info("SDP4Bit: compiled the kernels of %d kinds of call in %.1f s", len(new), seconds)
