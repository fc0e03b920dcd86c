"""Quantized weight all-gather: qWD (weight differences), qW (weights), exact.

Setting (sharded data parallelism): every DP rank holds the full model-weight
buffer (bf16 or fp32), identical on all ranks, and owns shard r of it (the
contiguous slice r of P equal slices) as an fp32 main-weight shard that the
optimizer just updated. The all-gather brings every rank's buffer up to date.

- ``diff`` (qWD): quantize ``main - model[r]``, all-gather codes and scales (one
  buffer per rank: its codes, then its scales, ``quant.wire_view``), and
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

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.buffer_names import weights_gather, weights_send
from megatron_sdp4bit.comm.accounting import WireRecorder, recorder_or_default
from megatron_sdp4bit.comm.argument_checks import check_float_tensors
from megatron_sdp4bit.comm.gather_hops import GatherHops
from megatron_sdp4bit.comm.handles import finish_or_handle
from megatron_sdp4bit.comm.primitives import all_gather_flat
from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS, MIN_SLICE_ELEMENTS, weight_slices, whole_bucket
from megatron_sdp4bit.comm.rounding_streams import pick_generator
from megatron_sdp4bit.comm.runner import Completion, StagedJob, run_or_submit
from megatron_sdp4bit.comm.topology import get_topology, peer_split
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant import (
    QuantizedTensor,
    dequantize,
    dequantize_add_,
    quantize,
    quantize_weight_diff,
    segment_layout,
    wire_view,
)

_COLLECTIVE = "all_gather"


def quantized_all_gather_weights(
    model_buffer: torch.Tensor,
    main_shard: torch.Tensor,
    group=None,
    config: Optional[SDP4BitConfig] = None,
    async_op: bool = False,
    generator: Optional[torch.Generator] = None,
    workspace: Optional[Workspace] = None,
    recorder: Optional[WireRecorder] = None,
    runner=None,
) -> Optional[Completion]:
    """Update ``model_buffer`` on every rank of ``group`` from all ranks' ``main_shard``.

    ``model_buffer`` (P * n elements, same values on every rank) is updated in
    place; ``main_shard`` (n elements) is this rank's fp32 shard, i.e. the new
    value of ``model_buffer[r*n:(r+1)*n]`` for group rank r. Mode, bits and
    group size come from ``config`` (default: qWD, 4 bits, group 2048,
    stochastic rounding). Like ``all_gather_into_tensor``: returns None, or with
    ``async_op`` a handle whose ``wait()`` joins the caller with the update. Do not
    touch ``model_buffer`` between the call and ``wait()``. ``workspace`` keeps the
    send and gather buffers for the next call (``comm/workspace.py``); the bytes sent
    count into ``recorder`` (default ``comm.accounting.DEFAULT_RECORDER``). ``runner``
    (``comm/runner.py``) runs the stages: with ``async_op`` they are submitted to it
    at call time, the synchronous call's stages in its order (so the result is
    bit-identical to it); it must be the one runner using ``group`` while it runs.
    Without a runner they run at call time, on the caller.
    """
    config = config if config is not None else SDP4BitConfig()
    group = group if group is not None else dist.group.WORLD
    dp_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _validate(model_buffer, main_shard, dp_size)
    shard = main_shard.numel()
    same, other = peer_split(group, config.ranks_per_node)
    wire = recorder_or_default(recorder)
    wire.call(_COLLECTIVE)
    wire.peer_sends(_COLLECTIVE, same, other, exact=shard * model_buffer.element_size())
    flat = model_buffer.view(-1)
    if dp_size == 1 or shard == 0:
        return finish_or_handle(lambda: flat.copy_(main_shard.view(-1)), async_op)
    if not config.quantize_weights:
        return _exact_all_gather(flat, main_shard, group, async_op, wire, (same, other), runner)

    gen = pick_generator(generator, config.rounding, main_shard.device, config.seed,
                         dist.get_rank(), "weights")
    own = flat[rank * shard: (rank + 1) * shard]
    targets = flat.view(dp_size, shard)  # row r: rank r's shard
    add = config.weight_mode == "diff"
    space = workspace if workspace is not None else Workspace()
    # two hops on a two-level topology (less on the nodes' links), else one flat gather
    two_level = config.weight_gather == "two-level"
    hops = GatherHops(group, get_topology(group, config.ranks_per_node) if two_level else None)

    def gather(start: int, stop: int, index: int) -> _Gather:
        """Quantize this rank's ``[start, stop)`` into its segment, start gathering every rank's."""
        n = stop - start
        layout = segment_layout(n, config.weight_bits, config.weight_group_size)
        outgoing = space.buffer(weights_send(index), layout.nbytes, flat.device)
        mine = wire_view(outgoing, 1, n, config.weight_bits, config.weight_group_size)
        fmt = dict(bits=config.weight_bits, group_size=config.weight_group_size,
                   rounding=config.rounding, generator=gen, out=mine)
        main = main_shard.view(-1)[start:stop]
        if add:
            quantize_weight_diff(main, own[start:stop], **fmt)
        else:
            quantize(main, **fmt)
        incoming = space.buffer(weights_gather(index), dp_size * layout.nbytes, flat.device)
        flight = hops.start(incoming, outgoing, space, index)
        scales = 4 * layout.groups
        hops.peer_sends(wire, _COLLECTIVE, same, other, codes=layout.codes_nbytes, scales=scales,
                        padding=layout.nbytes - layout.codes_nbytes - scales,
                        elements=layout.groups * config.weight_group_size)
        everyone = wire_view(incoming, dp_size, n, config.weight_bits, config.weight_group_size)
        return _Gather(targets[:, start:stop], everyone, flight)

    # Slice by slice (``_SliceGathers``), so a bucket of every parameter (megatron's
    # without overlap) needs a few slices' codes at a time, not the whole bucket's.
    # (one slice up to a runner's whole_bucket_elements: comm/runner.py)
    whole = whole_bucket(flat.numel(), runner.whole_bucket_elements if runner is not None else None)
    slices = weight_slices(shard, dp_size, config.weight_group_size, whole=whole,
                           max_chunk_elements=MAX_CHUNK_ELEMENTS,
                           min_slice_elements=MIN_SLICE_ELEMENTS)
    # The slots continue from the previous call on this workspace: its last slice's and
    # this call's first differ, so a thread runner may start this call while that
    # slice is still being applied (``_SliceGathers``).
    first_slot = space.next_slots("weights", len(slices))
    run = _SliceGathers(gather, slices, first_slot, add)
    return run_or_submit(runner, StagedJob(run.start, run.rest), async_op,
                         (model_buffer, main_shard))


def _exact_all_gather(flat: torch.Tensor, main_shard: torch.Tensor, group, async_op: bool,
                      wire: WireRecorder, peers, runner):
    """The unquantized path: this rank's shard in the buffer's dtype, torch's all-gather."""
    shard = main_shard.numel()
    wire.peer_sends(_COLLECTIVE, *peers, values=shard * flat.element_size(), elements=shard)
    if runner is None:  # torch's own async handle
        staged = main_shard.view(-1).to(flat.dtype, copy=True)
        work = all_gather_flat(flat, staged, group, async_op)
        return work if async_op else None

    def gather() -> None:
        all_gather_flat(flat, main_shard.view(-1).to(flat.dtype, copy=True), group, False)

    return run_or_submit(runner, gather, async_op, (flat, main_shard))


class _SliceGathers:
    """One call's slices: slice i + 1's gather in flight while slice i is applied. Two
    slots: slice i + 2 reuses slice i's buffers, applied (so waited for) before slice
    i + 2 is quantized.

    As a ``StagedJob``: ``start`` (the head) quantizes slice 0 and starts its gather;
    ``rest`` runs every other slice and returns the last slice's apply (the tail: a
    wait and a dequantize, no rounding draws), which a thread runner runs after the
    next call's head. That head takes the slot after this call's last one, and the
    next call's second slice (this call's last slot again) comes after the tail. The
    tail issues no collective: ``rest`` issues the last slice's (``InFlight.exchange``),
    so every rank issues them in the same order whenever its tail runs."""

    def __init__(self, gather: Callable[[int, int, int], "_Gather"], slices, first_slot: int,
                 add: bool):
        self.gather, self.slices, self.first_slot, self.add = gather, slices, first_slot, add
        self.previous: Optional[_Gather] = None

    def start(self) -> None:
        self.previous = self._gather(0)

    def rest(self) -> Callable[[], None]:
        for index in range(1, len(self.slices)):
            current = self._gather(index)
            self.previous.apply(self.add)
            self.previous = current
        last, self.previous = self.previous, None
        last.flight.exchange()
        return lambda: last.apply(self.add)

    def _gather(self, index: int) -> "_Gather":
        start, n = self.slices[index]
        return self.gather(start, start + n, self.first_slot + index)


class _Gather:
    """One slice's gather in flight: where it goes ([P, n] rows of the model buffer),
    every rank's quantized slice (one segment each, in the gather buffer), its hops."""

    def __init__(self, targets: torch.Tensor, everyone: QuantizedTensor, flight):
        self.targets, self.everyone, self.flight = targets, everyone, flight

    def apply(self, add: bool) -> None:
        """Wait, then add (``add``) or write every rank's dequantized slice: one launch."""
        self.flight.wait()
        if add:
            dequantize_add_(self.targets, self.everyone)
        else:
            self.targets.copy_(dequantize(self.everyone, torch.float32).view(self.targets.shape))


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
