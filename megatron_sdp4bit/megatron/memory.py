"""What the installed layer adds in memory for an optimizer's buckets (comm/memory_plan.py's
arithmetic over megatron's actual buckets, data-parallel group and node layout)."""
from __future__ import annotations

import torch

from megatron_sdp4bit.comm.memory_plan import LayerMemory, layer_memory
from megatron_sdp4bit.comm.topology import get_topology


def optimizer_memory(layer, optimizer, params: int) -> LayerMemory:
    """Held bytes, reused buffers and scratch peak on this rank; ``params``: model
    parameters on it.

    Collective over the data-parallel group the first time (it plans the node layout
    the reduce-scatter will use); every rank calls it at the same point.
    """
    state, adapter = layer.state, layer.adapter
    held = buffers = scratch = 0
    for sub in adapter.sub_optimizers(optimizer):
        _, dp = adapter.optimizer_group(sub)
        buckets = [bucket for _, bucket in adapter.buffer_buckets(sub)]
        if not buckets:
            continue
        levels = (get_topology(adapter.optimizer_process_group(sub), state.config.ranks_per_node).levels
                  if dp > 1 else ())
        node_members = (levels[0].size if len(levels) == 2 else
                        1 if levels and levels[0].name == "inter" else dp)
        grads = [adapter.bucket_grad_data(bucket) for bucket in buckets]
        params_data = [adapter.bucket_param_data(bucket) for bucket in buckets]
        part = layer_memory(
            [grad.numel() for grad in grads], dp, state.config, params=params,
            node_members=node_members, whole_bucket_elements=state.runner.whole_bucket_elements,
            fp32_params=any(data is not None and data.dtype == torch.float32 for data in params_data))
        held += part.held_bytes
        buffers += part.buffer_bytes
        scratch = max(scratch, part.scratch_bytes)  # one model chunk's collectives at a time
    return LayerMemory(params=params, held_bytes=held, buffer_bytes=buffers, scratch_bytes=scratch)
