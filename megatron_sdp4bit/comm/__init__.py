"""Quantized collectives on torch.distributed (gloo and NCCL); no Megatron inside.

- ``quantized_all_gather_weights(model_buffer, main_shard, group, config, async_op)``:
  qWD / qW / exact weight all-gather (``weights.py``).
- ``quantized_reduce_scatter(output, input, op, group, config, async_op)``:
  TLq-HS / TLq / ULq / exact gradient reduce-scatter (``gradients.py``).
- ``get_topology`` / ``build_topologies``: intra- and inter-node subgroups of a
  DP group (``topology.py``); pure layout rules in ``layout.py``.
- ``get_wire_stats`` / ``reset_wire_stats``: bytes sent per collective, level
  and kind, next to what the exact collective would have sent (``accounting.py``).

Contracts and a usage example: docs/collectives.md.
"""
from megatron_sdp4bit.comm.accounting import WireStats, get_wire_stats, reset_wire_stats
from megatron_sdp4bit.comm.gradients import quantized_reduce_scatter
from megatron_sdp4bit.comm.handles import PendingCollective
from megatron_sdp4bit.comm.rounding_streams import RoundingStreams, generator_states, reset_generators, set_generator_states
from megatron_sdp4bit.comm.topology import (
    Topology,
    build_topologies,
    forget_subgroups,
    get_topology,
    reset_topology_cache,
)
from megatron_sdp4bit.comm.weights import quantized_all_gather_weights

__all__ = [
    "quantized_all_gather_weights", "quantized_reduce_scatter", "PendingCollective",
    "Topology", "get_topology", "build_topologies", "reset_topology_cache", "forget_subgroups",
    "WireStats", "get_wire_stats", "reset_wire_stats", "RoundingStreams", "reset_generators",
    "generator_states", "set_generator_states",
]
