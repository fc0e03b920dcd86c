"""Quantized weight all-gather: qWD (weight differences), qW (weights), exact.

Setting (sharded data parallelism): every DP rank holds the full model-weight
buffer (bf16 or fp32), identical on all ranks, and owns shard r of it (the
contiguous slice r of P equal slices) as an fp32 main-weight shard that the
optimizer just updated. The all-gather brings every rank's buffer up to date.

- ``diff`` (qWD): quantize ``main - model[r]``, all-gather codes and scales, and
  on every rank add the dequantized differences into *all* shards, the owner's
  included. Every rank applies the same bytes with the same arithmetic, so the
  buffers stay bit-identical; and since the next difference is taken against
  the reconstructed weights, each step's quantization error is corrected by
  the next (error feedback, no extra memory).
- ``direct`` (qW, ZeRO++ qwZ): quantize the weights themselves; every rank
  overwrites all shards with the dequantized values.
- ``off``: the exact all-gather of ``main`` cast to the buffer's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.accounting import record_call, record_peer_sends
from megatron_sdp4bit.comm.checks import check_float_tensors
from megatron_sdp4bit.comm.handles import PendingCollective, finish_or_handle
from megatron_sdp4bit.comm.primitives import all_gather_flat
from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS
from megatron_sdp4bit.comm.rng import pick_generator
from megatron_sdp4bit.comm.topology import peer_split
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant import (
    QuantizedTensor,
    dequantize,
    dequantize_add_,
    quantize,
    quantize_weight_diff,
)

_COLLECTIVE = "all_gather"


def quantized_all_gather_weights(
    model_buffer: torch.Tensor,
    main_shard: torch.Tensor,
    group=None,
    config: Optional[SDP4BitConfig] = None,
    async_op: bool = False,
    generator: Optional[torch.Generator] = None,
) -> Optional[PendingCollective]:
    """Update ``model_buffer`` on every rank of ``group`` from all ranks' ``main_shard``.

    ``model_buffer`` (P * n elements, same values on every rank) is updated in
    place; ``main_shard`` (n elements) is this rank's fp32 shard, i.e. the new
    value of ``model_buffer[r*n:(r+1)*n]`` for group rank r. Mode, bits and
    group size come from ``config`` (default: qWD, 4 bits, group 2048,
    stochastic rounding). Like ``all_gather_into_tensor``: returns None, or with
    ``async_op`` a handle whose ``wait()`` applies the update. Do not touch
    ``model_buffer`` between the call and ``wait()``.
    """
    config = config if config is not None else SDP4BitConfig()
    group = group if group is not None else dist.group.WORLD
    dp_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _validate(model_buffer, main_shard, dp_size)
    shard = main_shard.numel()
    same, other = peer_split(group, config.ranks_per_node)
    record_call(_COLLECTIVE)
    record_peer_sends(_COLLECTIVE, same, other, exact=shard * model_buffer.element_size())
    flat = model_buffer.view(-1)
    if dp_size == 1 or shard == 0:
        return finish_or_handle(lambda: flat.copy_(main_shard.view(-1)), async_op)
    if not config.quantize_weights:
        staged = main_shard.view(-1).to(model_buffer.dtype, copy=True)
        record_peer_sends(_COLLECTIVE, same, other,
                          values=shard * model_buffer.element_size(), elements=shard)
        work = all_gather_flat(flat, staged, group, async_op)
        return work if async_op else None

    gen = pick_generator(generator, config.rounding, main_shard.device, config.seed,
                         dist.get_rank(), "weights")
    own = flat[rank * shard: (rank + 1) * shard]
    add = config.weight_mode == "diff"

    def gather(start: int, stop: int) -> _Gather:
        """Quantize this rank's ``[start, stop)`` and start gathering every rank's."""
        fmt = dict(bits=config.weight_bits, group_size=config.weight_group_size,
                   rounding=config.rounding, generator=gen)
        main = main_shard.view(-1)[start:stop]
        q = quantize_weight_diff(main, own[start:stop], **fmt) if add else quantize(main, **fmt)
        codes, scales = q.codes.contiguous(), q.scales.contiguous()
        all_codes = codes.new_empty(dp_size * codes.numel())
        all_scales = scales.new_empty(dp_size * scales.numel())
        works = [all_gather_flat(all_codes, codes, group, True),
                 all_gather_flat(all_scales, scales, group, True)]
        record_peer_sends(_COLLECTIVE, same, other, codes=codes.numel() * codes.element_size(),
                          scales=scales.numel() * scales.element_size(), elements=q.padded_numel)
        return _Gather(start, q, all_codes, all_scales, works, (codes, scales))

    if async_op:  # every rank's codes of the whole shard in flight at once
        pending = gather(0, shard)
        return finish_or_handle(lambda: pending.apply(flat, shard, dp_size, add), True)
    # Slice by slice, the next slice's gather in flight while this one is applied:
    # a bucket of every parameter (megatron's without overlap) needs a few slices'
    # codes at a time, not the whole bucket's.
    step = _slice_elements(shard, dp_size, config.weight_group_size)
    previous = None
    for start in range(0, shard, step):
        current = gather(start, min(start + step, shard))
        if previous is not None:
            previous.apply(flat, shard, dp_size, add)
        previous = current
    previous.apply(flat, shard, dp_size, add)
    return None


def _slice_elements(shard: int, dp_size: int, group_size: int) -> int:
    """Shard elements per slice of a synchronous gather: whole groups, at most
    ``MAX_CHUNK_ELEMENTS`` over all ranks (one slice when the shard is small)."""
    groups = max(1, MAX_CHUNK_ELEMENTS // (dp_size * group_size))
    return min(shard, groups * group_size)


class _Gather:
    """One slice's gather in flight: this rank's quantized slice, every rank's buffers."""

    def __init__(self, start, q: QuantizedTensor, all_codes, all_scales, works, send_buffers):
        self.start, self.q = start, q
        self.all_codes, self.all_scales = all_codes, all_scales
        self.works = works
        self.send_buffers = send_buffers  # referenced until the gather ends

    def apply(self, flat: torch.Tensor, shard: int, dp_size: int, add: bool) -> None:
        """Wait, then write (``add``: add) every rank's dequantized slice into ``flat``."""
        for work in self.works:
            work.wait()
        local, numel = self.q, self.q.numel
        if numel == shard and numel == local.padded_numel:  # contiguous: one call for all
            pieces = [(flat, self.all_codes, self.all_scales, dp_size * shard)]
        else:
            n_codes, n_scales = local.codes.numel(), local.scales.numel()
            pieces = [(flat[r * shard + self.start: r * shard + self.start + numel],
                       self.all_codes[r * n_codes: (r + 1) * n_codes],
                       self.all_scales[r * n_scales: (r + 1) * n_scales], numel)
                      for r in range(dp_size)]
        for target, codes, scales, count in pieces:
            q = QuantizedTensor(codes=codes, scales=scales, bits=local.bits,
                                group_size=local.group_size, numel=count, dtype=torch.float32)
            if add:
                dequantize_add_(target, q)
            else:
                target.copy_(dequantize(q, torch.float32))


def _validate(model_buffer: torch.Tensor, main_shard: torch.Tensor, dp_size: int) -> None:
    check_float_tensors(model_buffer=model_buffer, main_shard=main_shard)
    if model_buffer.device != main_shard.device:
        raise ValueError(f"model_buffer is on {model_buffer.device} but main_shard on "
                         f"{main_shard.device}; put both on the same device")
    if model_buffer.numel() != dp_size * main_shard.numel():
        raise ValueError(
            f"model_buffer has {model_buffer.numel()} elements but must have DP size "
            f"({dp_size}) x main_shard ({main_shard.numel()}) = {dp_size * main_shard.numel()}"
        )
