"""Memory the SDP4Bit layer adds on a rank: pure arithmetic over the buffers it allocates.

Three kinds, reported separately because they scale differently:

- **held**, from one step to the next: qWD's exact fp32 main shard of every
  bucket (1/DP of it, 4 bytes per element), which the next step's difference is
  taken against; with fp32 parameters also the reconstructed weights set aside
  while the optimizer steps (another 1/DP). Nothing is held when the weights are
  not quantized or DP is 1.
- **buffers**: the send and receive buffers the collectives reuse from call to
  call (``comm/workspace.py``), kept from the first step on. The layer's
  collectives run one after another on its runner (``comm/runner.py``: one worker
  thread or one side stream), so one workspace per direction serves every bucket,
  overlapped or not. A reduce-scatter works in chunks of at most
  ``MAX_CHUNK_ELEMENTS`` that take turns on two slots; a weight all-gather in
  slices of that size, on two slots as well.
- **scratch**, alive while a collective runs: what ``comm`` allocates per call
  besides those (qW's dequantized weights of a slice), counted as the GPU (Triton)
  path allocates them, whose kernels allocate nothing of their own with ``out=``.

The counts follow ``comm/weights.py``, ``comm/gradients.py`` and the layer's use
of workspaces (``megatron/grad_sync.py``, ``megatron/param_sync.py``), name for
name: a change to what those allocate belongs here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence

from megatron_sdp4bit.comm.buffer_names import (GRADS_SUM, SLOTS, grads_hop, weights_by_local_rank,
                                                weights_gather, weights_send)
from megatron_sdp4bit.comm.layout import (MAX_CHUNK_ELEMENTS, chunk_count, chunk_plan, weight_slices,
                                          whole_bucket)
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant.types import QuantizedTensor, num_groups
from megatron_sdp4bit.quant.wire import segment_nbytes

SCALE_BYTES = 4  # one fp32 scale per group
MAIN_BYTES = 4  # fp32 main weights


def quantized_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Codes and scales of ``numel`` elements quantized at ``bits`` in groups."""
    return QuantizedTensor.codes_nbytes(numel, bits, group_size) + SCALE_BYTES * num_groups(numel, group_size)


@dataclass(frozen=True)
class LayerMemory:
    """What the layer adds to a rank's memory, beyond Megatron's own buffers."""

    params: int
    """Model parameters on this rank (the denominator of the per-parameter figures)."""
    held_bytes: int
    """Kept across steps (fp32 main shards)."""
    buffer_bytes: int
    """The collectives' reused send and receive buffers."""
    scratch_bytes: int
    """Allocated during one collective and freed after it."""

    def per_param(self, nbytes: int) -> float:
        return nbytes / self.params if self.params else 0.0

    @property
    def total_bytes(self) -> int:
        return self.held_bytes + self.buffer_bytes + self.scratch_bytes

    def describe(self) -> str:
        return (f"+{self.per_param(self.total_bytes):.2f} B/param per rank at most: "
                f"{self.per_param(self.held_bytes):.2f} held (fp32 main shards, "
                f"{self.held_bytes / 2**20:.1f} MiB) + {self.per_param(self.buffer_bytes):.2f} "
                f"reused send/receive buffers ({self.buffer_bytes / 2**20:.1f} MiB) + "
                f"{self.per_param(self.scratch_bytes):.2f} scratch during a collective "
                f"({self.scratch_bytes / 2**20:.1f} MiB)")


def held_bytes(bucket_numels: Sequence[int], dp: int, config: SDP4BitConfig,
               fp32_params: bool) -> int:
    """Bytes the layer keeps across steps for buckets of these (DP-padded) sizes."""
    if dp == 1 or not config.quantize_weights:
        return 0
    per_element = MAIN_BYTES * (2 if fp32_params else 1)
    return sum(per_element * (numel // dp) for numel in bucket_numels)


def _grad_levels(dp: int, node_members: int) -> list:
    """(level, peers) of each hop, as the topology lays them out: ``node_members`` DP
    ranks per node (1: one inter-node level; 0 or dp: one node; else two levels)."""
    if 1 < node_members < dp:
        return [("intra", node_members), ("inter", dp // node_members)]
    return [("inter" if node_members == 1 else "intra", dp)]


def _merge_max(demands: Iterable[Dict[str, int]]) -> Dict[str, int]:
    """What one workspace keeps after serving these demands: the largest per name."""
    merged: Dict[str, int] = {}
    for demand in demands:
        for name, nbytes in demand.items():
            merged[name] = max(merged.get(name, 0), nbytes)
    return merged


def grad_buffer_demand(bucket_numel: int, dp: int, config: SDP4BitConfig,
                       node_members: int,
                       whole_bucket_elements: Optional[int] = None) -> Dict[str, int]:
    """Bytes per workspace buffer name that one bucket's quantized reduce-scatter asks for
    (in one chunk up to a runner's ``whole_bucket_elements``: ``layout.whole_bucket``)."""
    shard = bucket_numel // dp
    if dp == 1 or shard == 0 or not config.quantize_grads:
        return {}
    levels = _grad_levels(dp, node_members)
    align = config.grad_alignment([level for level, _ in levels])
    cap = dp * shard if whole_bucket(bucket_numel, whole_bucket_elements) else MAX_CHUNK_ELEMENTS
    plan = chunk_plan(shard, align, chunk_count(shard, dp, config.pipeline_chunks, cap))
    demands = []
    for index, chunk in enumerate(plan):
        if chunk.valid < chunk.padded:  # the shard's unaligned end, summed in fp32 first
            demands.append({GRADS_SUM: MAIN_BYTES * chunk.padded})
        numel = dp * chunk.padded
        for hop, (level, peers) in enumerate(levels):
            bits, group = config.grad_hop_format(level)
            nbytes = peers * segment_nbytes(numel // peers, bits, group)
            demands.append({grads_hop(hop, kind, index): nbytes for kind in ("send", "receive")})
            numel //= peers
    return _merge_max(demands)


def weight_buffer_demand(bucket_numel: int, dp: int, config: SDP4BitConfig,
                         node_members: int = 0,
                         whole_bucket_elements: Optional[int] = None) -> Dict[str, int]:
    """Bytes per workspace buffer name of one bucket's qW/qWD all-gather, slice by slice in
    two slots: this rank's segment and every rank's; on two levels (``node_members`` DP
    ranks per node, as ``grad_buffer_demand``) every rank's before the copy into DP order,
    which the hop across nodes writes its part of (``comm/gather_hops.py``). (Exact gathers
    add nothing.)"""
    shard = bucket_numel // dp
    if dp == 1 or shard == 0 or not config.quantize_weights:
        return {}
    demands = []
    slices = weight_slices(shard, dp, config.weight_group_size,
                           whole_bucket(bucket_numel, whole_bucket_elements), MAX_CHUNK_ELEMENTS)
    # A call starts on the slot after the previous call's last (Workspace.next_slots),
    # which depends on the buckets before it: any slice may land in any slot.
    for first in range(SLOTS):
        for index, (_, n) in enumerate(slices):
            own = segment_nbytes(n, config.weight_bits, config.weight_group_size)
            demand = {weights_send(first + index): own, weights_gather(first + index): dp * own}
            if config.weight_gather == "two-level" and len(_grad_levels(dp, node_members)) == 2:
                demand[weights_by_local_rank(first + index)] = dp * own
            demands.append(demand)
    return _merge_max(demands)


def weight_gather_scratch(bucket_numel: int, dp: int, config: SDP4BitConfig,
                          whole_bucket_elements: Optional[int] = None) -> int:
    """Bytes one bucket's weight all-gather allocates per call besides its workspace:
    qW's dequantized fp32 weights of a slice (qWD adds into the model buffer in place)."""
    shard = bucket_numel // dp
    if dp == 1 or shard == 0 or config.weight_mode != "direct":
        return 0
    slices = weight_slices(shard, dp, config.weight_group_size,
                           whole_bucket(bucket_numel, whole_bucket_elements), MAX_CHUNK_ELEMENTS)
    return MAIN_BYTES * dp * max(n for _, n in slices)


def layer_memory(bucket_numels: Sequence[int], dp: int, config: SDP4BitConfig, *,
                 params: int, node_members: int, fp32_params: bool,
                 whole_bucket_elements: Optional[int] = None) -> LayerMemory:
    """Held bytes, reused buffers and the scratch peak of one rank for buckets of these sizes.

    One workspace per direction serves every bucket (the runner runs one collective at
    a time), so the buffers are the largest demand per buffer name; the scratch is the
    largest weight gather's (the reduce-scatter keeps all it uses in its workspace).
    ``whole_bucket_elements``: the runner's (``comm/runner.py``), up to which a bucket's
    collectives run in one chunk and one slice.
    """
    buckets = [int(n) for n in bucket_numels]
    whole = whole_bucket_elements
    grad_buffers = sum(_merge_max(grad_buffer_demand(n, dp, config, node_members, whole)
                                  for n in buckets).values())
    weight_buffers = sum(_merge_max(weight_buffer_demand(n, dp, config, node_members, whole)
                                    for n in buckets).values())
    scratch = max([weight_gather_scratch(n, dp, config, whole) for n in buckets], default=0)
    return LayerMemory(params=params, held_bytes=held_bytes(buckets, dp, config, fp32_params),
                       buffer_bytes=grad_buffers + weight_buffers, scratch_bytes=scratch)
