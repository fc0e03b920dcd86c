"""Memory the SDP4Bit layer adds on a rank: pure arithmetic over the buffers it allocates.

Two kinds, reported separately because they scale differently:

- **held**, from one step to the next: qWD's exact fp32 main shard of every
  bucket (1/DP of it, 4 bytes per element), which the next step's difference is
  taken against; with fp32 parameters also the reconstructed weights set aside
  while the optimizer steps (another 1/DP). Nothing is held when the weights are
  not quantized or DP is 1.
- **scratch**, alive while a collective runs: the code and scale buffers of the
  quantized all-gather and reduce-scatter, counted as the GPU (Triton) path
  allocates them, whose kernels allocate only their outputs. A reduce-scatter
  works in chunks of at most ``MAX_CHUNK_ELEMENTS`` launched one after another
  and keeps a few alive (megatron makes one bucket of every parameter without
  --overlap-grad-reduce); with --overlap-grad-reduce a bucket's reduce-scatter
  completes when the next bucket's starts, which has one chunk in flight by then.
  A synchronous all-gather works in slices of that size; an overlapped one
  gathers a whole bucket, two buckets at a time. Scratch is an upper bound: it
  counts every buffer of the step where most are alive at once.

The counts follow ``comm/weights.py``, ``comm/gradients.py`` and
``megatron/grad_sync.py``; a change to what those allocate belongs here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS, chunk_count, chunk_plan, lcm
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant.types import QuantizedTensor, num_groups

SCALE_BYTES = 4  # one fp32 scale per group
MAIN_BYTES = 4  # fp32 main weights


def quantized_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Codes and scales of ``numel`` elements quantized at ``bits`` in groups."""
    return QuantizedTensor.codes_nbytes(numel, bits, group_size) + SCALE_BYTES * num_groups(numel, group_size)


@dataclass(frozen=True)
class LayerMemory:
    params: int
    """Model parameters on this rank (the denominator of the per-parameter figures)."""
    held_bytes: int
    scratch_bytes: int

    def per_param(self, nbytes: int) -> float:
        return nbytes / self.params if self.params else 0.0

    @property
    def total_bytes(self) -> int:
        return self.held_bytes + self.scratch_bytes

    def describe(self) -> str:
        return (f"+{self.per_param(self.total_bytes):.2f} B/param per rank at most: "
                f"{self.per_param(self.held_bytes):.2f} held (fp32 main shards, "
                f"{self.held_bytes / 2**20:.1f} MiB) + {self.per_param(self.scratch_bytes):.2f} "
                f"scratch during a collective ({self.scratch_bytes / 2**20:.1f} MiB)")


def held_bytes(bucket_numels: Sequence[int], dp: int, config: SDP4BitConfig,
               fp32_params: bool) -> int:
    """Bytes the layer keeps across steps for buckets of these (DP-padded) sizes."""
    if dp == 1 or not config.quantize_weights:
        return 0
    per_element = MAIN_BYTES * (2 if fp32_params else 1)
    return sum(per_element * (numel // dp) for numel in bucket_numels)


def weight_gather_scratch(bucket_numel: int, dp: int, config: SDP4BitConfig,
                          whole_bucket: bool = True) -> int:
    """One bucket's qW/qWD all-gather: this rank's codes and every rank's. (Exact
    gathers are megatron's own and add nothing.) ``whole_bucket``: gathered at once
    (async, with --overlap-param-gather); otherwise slice by slice, two slices alive."""
    shard = bucket_numel // dp
    if dp == 1 or shard == 0 or not config.quantize_weights:
        return 0
    one = lambda n: (dp + 1) * quantized_nbytes(n, config.weight_bits, config.weight_group_size)  # noqa: E731
    if whole_bucket:
        return one(shard)
    groups = max(1, MAX_CHUNK_ELEMENTS // (dp * config.weight_group_size))
    step = min(shard, groups * config.weight_group_size)
    return one(step) * (2 if step < shard else 1)


def grad_scatter_scratch(bucket_numel: int, dp: int, config: SDP4BitConfig, node_members: int,
                         grad_bytes: int, overlapped: bool) -> int:
    """One bucket's quantized reduce-scatter at its fullest.

    ``node_members``: DP ranks per node when the reduce-scatter has two levels
    (intra- then inter-node), 0 or ``dp`` when it has one.
    Chunks are launched one after another, sync or async alike: at most two
    chunks' first hops, two second hops and one chunk's staging copy are alive.
    ``overlapped`` (--overlap-grad-reduce): the bucket is completed when the next
    bucket's reduce-scatter is about to start, whose first chunk then goes in
    flight (an upper bound: on a GPU the completed bucket's last buffers may still
    be in use by the transfer when the next one's are allocated).
    """
    shard = bucket_numel // dp
    if dp == 1 or shard == 0 or not config.quantize_grads:
        return 0
    intra_bits = config.effective_grad_bits_intra
    formats = [(intra_bits, config.grad_group_size_intra)]
    two_level = 1 < node_members < dp
    if two_level:
        formats.append((config.grad_bits_inter, config.grad_group_size_inter))
    block = config.hadamard_block if config.use_hadamard else 1
    align = lcm(*(group for _, group in formats), block)
    chunks = chunk_plan(shard, align, chunk_count(shard, dp, config.pipeline_chunks,
                                                  MAX_CHUNK_ELEMENTS))

    def first_hop(chunk):  # send and receive buffers over all DP shards of the chunk
        return 2 * quantized_nbytes(dp * chunk.padded, *formats[0])

    def second_hop(chunk):
        if not two_level:
            return 0
        return 2 * quantized_nbytes(dp * chunk.padded // node_members, *formats[1])

    def staging(chunk):  # the chunk's rows in send order, zero-padded; the summed output
        # one copy unless the chunk's rows are the bucket itself, in order and unpadded
        copied = two_level or len(chunks) > 1 or chunk.valid < chunk.padded
        return copied * dp * chunk.padded * grad_bytes + MAIN_BYTES * chunk.padded

    largest = max(chunks, key=lambda c: c.padded)
    pipeline = 2 * first_hop(largest) + 2 * second_hop(largest) + staging(largest)
    return pipeline + (first_hop(largest) if overlapped else 0)


def layer_memory(bucket_numels: Sequence[int], dp: int, config: SDP4BitConfig, *,
                 params: int, node_members: int, fp32_params: bool,
                 grad_bytes: int = 4, overlap_grad_reduce: bool = False,
                 overlap_param_gather: bool = False) -> LayerMemory:
    """Held bytes and the scratch peak of one rank for buckets of these sizes.

    Gradients and weights are not in flight at the same time (backward, then the
    optimizer and the next forward), so the peak is the larger of the two phases.
    """
    buckets = sorted((int(n) for n in bucket_numels), reverse=True)
    grads = [grad_scatter_scratch(n, dp, config, node_members, grad_bytes,
                                  overlapped=overlap_grad_reduce) for n in buckets]
    gathers = [weight_gather_scratch(n, dp, config, whole_bucket=overlap_param_gather)
               for n in buckets]
    grad_peak = max(grads, default=0)
    in_flight = 2  # overlapped gathers: the next bucket's starts before this one's ends
    gather_peak = sum(sorted(gathers, reverse=True)[:in_flight if overlap_param_gather else 1])
    return LayerMemory(params=params, held_bytes=held_bytes(buckets, dp, config, fp32_params),
                       scratch_bytes=max(grad_peak, gather_peak, 0))
