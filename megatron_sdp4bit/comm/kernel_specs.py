"""The kernel calls a collective will make, as ``quant.KernelSpec``s: what to warm up.

Triton compiles a kernel variant the first time a call needs it, on every rank,
inside the first training step (1-2 s each). ``quant.warm_up(specs, device)``
compiles them ahead from specs; these functions say which calls the collectives
of ``gradients.py`` and ``weights.py`` make for a bucket, with the same chunk
plan, formats and buffer layouts, so a real call afterwards finds its variant.
That includes where the caller's tensors start: a shard at its rank's offset in a
bucket starts off a 16-byte boundary when shard x element size is not a multiple
of 16 (e.g. DP 128 with bf16 parameters), and Triton compiles another variant for
it; ``alignment_offset`` gives the offsets the specs need, from the real tensors.
The patch layer warms up every bucket's specs when DDP is built.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS, chunk_count, chunk_plan, weight_slices
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant import KernelSpec


ALIGNMENT_BYTES = 16
"""The pointer alignment Triton specialises on."""


def alignment_offset(tensor: torch.Tensor, elements: int = 0) -> int:
    """Elements past a 16-byte boundary at which ``tensor``'s element ``elements`` lies
    (the ``KernelSpec.offset`` of a call on a view starting there)."""
    size = tensor.element_size()
    return (tensor.data_ptr() + elements * size) % ALIGNMENT_BYTES // size


def _offset(offset: int, elements: int, dtype: torch.dtype) -> int:
    """``offset`` + ``elements`` as an offset below one 16-byte boundary (one spec per class)."""
    return (offset + elements) % (ALIGNMENT_BYTES // dtype.itemsize)


def reduce_scatter_specs(shard: int, dtype: torch.dtype, levels: Sequence[Tuple[str, int]],
                         config: SDP4BitConfig, average: bool, ordered: bool,
                         input_offset: int = 0, output_offset: int = 0,
                         whole: bool = False) -> List[KernelSpec]:
    """The kernels of one quantized reduce-scatter of a ``shard``-element output over
    ``levels`` ((name, members) of each hop, ``Topology.levels``), chunk by chunk.

    ``ordered``: the send order is not the identity (two levels); ``average``: AVG.
    ``input_offset`` / ``output_offset``: ``alignment_offset`` of the input (the bucket)
    and of the output (megatron's: this rank's shard of the bucket).
    ``whole``: the bucket in one chunk (a runner's ``whole_bucket_elements``,
    ``layout.whole_bucket``).
    """
    dp = 1
    for _, size in levels:
        dp *= size
    if dp == 1 or shard == 0 or not config.quantize_grads:
        return []
    formats = [config.grad_hop_format(name) for name, _ in levels]
    block = config.grad_hadamard_block
    align = config.grad_alignment([name for name, _ in levels])
    specs = []
    cap = dp * shard if whole else MAX_CHUNK_ELEMENTS
    for chunk in chunk_plan(shard, align, chunk_count(shard, dp, config.pipeline_chunks, cap)):
        (bits, group), peers = formats[0], levels[0][1]
        specs.append(KernelSpec("hadamard_quantize_rows", dp * chunk.padded, bits, group,
                                chunks=peers, rounding=config.rounding, dtype=dtype,
                                hadamard_block=block, scaled=average, rows=dp, row_numel=shard,
                                start=chunk.start, valid=chunk.valid, ordered=ordered,
                                offset=_offset(input_offset, 0, dtype)))
        numel = dp * chunk.padded // peers  # one peer's part, arrived from each of them
        if len(levels) == 2:
            (bits2, group2), nodes = formats[1], levels[1][1]
            specs.append(KernelSpec("dequantize_sum_requantize", peers * numel, bits, group,
                                    chunks=peers, rounding=config.rounding, out_bits=bits2,
                                    out_group_size=group2, out_chunks=nodes))
            bits, group, peers, numel = bits2, group2, nodes, numel // nodes
        aligned = chunk.valid == chunk.padded  # else an fp32 sum into a workspace buffer, then a copy
        specs.append(KernelSpec("dequantize_sum", peers * numel, bits, group, chunks=peers,
                                dtype=dtype if aligned else torch.float32,
                                hadamard_block=block,
                                offset=_offset(output_offset, chunk.start, dtype) if aligned else 0))
    return specs


def all_gather_specs(shard: int, dp: int, model_dtype: torch.dtype,
                     config: SDP4BitConfig, rank: int = 0, buffer_offset: int = 0,
                     whole: bool = False) -> List[KernelSpec]:
    """The kernels of one quantized weight all-gather of ``shard``-element shards into a
    ``model_dtype`` buffer (in slices, overlapped or not) by group rank ``rank``, whose
    buffer starts at ``buffer_offset`` (``alignment_offset``); ``whole``: in one slice (a
    runner's ``whole_bucket_elements``, ``layout.whole_bucket``)."""
    if dp == 1 or shard == 0 or not config.quantize_weights:
        return []
    fmt = dict(bits=config.weight_bits, group_size=config.weight_group_size)
    specs = []
    for start, n in weight_slices(shard, dp, config.weight_group_size, whole, MAX_CHUNK_ELEMENTS):
        if config.weight_mode == "diff":
            own = _offset(buffer_offset, rank * shard + start, model_dtype)  # this rank's shard
            specs.append(KernelSpec("quantize_weight_diff", n, rounding=config.rounding,
                                    dtype=model_dtype, offset=own, **fmt))
            specs.append(KernelSpec("dequantize_add_", dp * n, chunks=dp, dtype=model_dtype,
                                    row_numel=shard, start=start,
                                    offset=_offset(buffer_offset, 0, model_dtype), **fmt))
        else:
            specs.append(KernelSpec("quantize", n, rounding=config.rounding, **fmt))
            specs.append(KernelSpec("dequantize", dp * n, chunks=dp, **fmt))
    return specs
