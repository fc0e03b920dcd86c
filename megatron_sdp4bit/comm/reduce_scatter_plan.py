"""A quantized reduce-scatter worked out once per call shape: buffers, views, launches.

Megatron reduce-scatters the same buckets into the same shards every step, and
each pipeline chunk makes the same three kernel calls and two all-to-alls on the
same buffers. What those calls need beyond the data (the chunk plan, the wire
views of the send and receive buffers, the kernels' bound and checked arguments,
their strides, tiling and variant: ``quant.prepare``) is worked out once, kept in
the caller's ``Workspace`` (``Workspace.plan``) and reused while the workspace's
buffers stay where they are. A step then costs, per chunk, two seed draws, three
launches and two collective calls.

The plan requests every buffer it uses before it makes any view of one, each at
the largest size any of its chunks asks, so no request of its own moves a buffer
that one of its views points into.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from megatron_sdp4bit import quant
from megatron_sdp4bit.comm.buffer_names import GRADS_SUM, grads_hop
from megatron_sdp4bit.comm.layout import (
    MAX_CHUNK_ELEMENTS,
    MIN_CHUNK_SHARD_ELEMENTS,
    Chunk,
    chunk_count,
    chunk_plan,
)
from megatron_sdp4bit.comm.topology import Level, Topology
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant import QuantizedTensor, segment_layout, segment_nbytes, wire_view


@dataclass
class Hop:
    """One chunk's all-to-all over the topology's level ``index``: the bytes sent and
    received, and how the received bytes read (one segment per peer). The process group
    is not kept here: a plan outlives no process group (``topology.forget_subgroups``)."""

    index: int
    name: str  # "intra" or "inter"
    peers: int
    outgoing: torch.Tensor
    incoming: torch.Tensor
    received: QuantizedTensor
    sent_per_peer: Tuple[int, int, int, int]
    """(codes, scales, padding, elements) one peer's segment carries."""


@dataclass
class ChunkSteps:
    """One pipeline chunk's prepared work, in the order it runs."""

    chunk: Chunk
    quantize: Callable  # run(generator): the first hop's codes, into hops[0].outgoing
    hops: List[Hop]
    requantize: Optional[Callable]  # two levels: run(generator), hop 0's sum into hop 1's send
    write: Callable  # run(): the last hop's sum (inverse Hadamard) into the output


class ReduceScatterPlan:
    """Every chunk's ``ChunkSteps`` for one (output, input, op, topology, config);
    ``levels``: how many hops each chunk makes; ``buffers``: the workspace buffers it
    uses (allocated on the caller's stream). ``whole``: one chunk (unless
    ``pipeline_chunks`` asks for more; ``layout.whole_bucket``), else chunks of at most
    ``MAX_CHUNK_ELEMENTS`` over all shards."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, average: bool,
                 topology: Topology, config: SDP4BitConfig, workspace: Workspace,
                 whole: bool = False):
        self.levels = len(topology.levels)
        formats = [config.grad_hop_format(level.name) for level in topology.levels]
        block = config.grad_hadamard_block
        shard = output.numel()
        dp = topology.dp_size
        align = config.grad_alignment([level.name for level in topology.levels])
        cap = dp * shard if whole else MAX_CHUNK_ELEMENTS
        chunks = chunk_plan(shard, align, chunk_count(shard, dp, config.pipeline_chunks, cap,
                                                      MIN_CHUNK_SHARD_ELEMENTS))
        device = input.device
        buffers = _buffers(workspace, chunks, dp, topology.levels, formats, device)
        # A side stream uses them: its runner records them there, so that a buffer the
        # workspace replaces goes back to the allocator only once that stream is done.
        self.buffers = tuple(buffers.values())
        # Views of detached aliases: a view would keep the caller's tensor object alive,
        # and the workspace keeps a plan only while that object lives (Workspace.plan).
        rows = input.detach().view(dp, shard)
        order = topology.send_order_index(device)
        scale = 1.0 / dp if average else 1.0
        flat_output = output.detach().view(-1)
        self.chunks: List[ChunkSteps] = []
        for index, chunk in enumerate(chunks):
            hops, numel = [], dp * chunk.padded
            for hop, level in enumerate(topology.levels):
                hops.append(_hop(buffers, index, hop, level, numel, formats[hop]))
                numel //= level.size
            bits, group = formats[0]
            quantize = quant.prepare(
                "hadamard_quantize_rows", rows, order, chunk.start, chunk.valid, chunk.padded,
                bits=bits, group_size=group, hadamard_block=block, rounding=config.rounding,
                scale=scale, out=_send_view(hops[0], formats[0]))
            requantize = None
            if len(hops) == 2:
                bits, group = formats[1]
                requantize = quant.prepare(
                    "dequantize_sum_requantize", hops[0].received, num_chunks=hops[0].peers,
                    bits=bits, group_size=group, rounding=config.rounding,
                    out=_send_view(hops[1], formats[1]))
            dest = flat_output[chunk.start: chunk.start + chunk.valid]
            self.chunks.append(ChunkSteps(chunk, quantize, hops, requantize,
                                          _write(hops[-1], dest, chunk, block, buffers)))


def _buffers(workspace: Workspace, chunks, dp: int, levels, formats, device) -> dict:
    """Every buffer the chunks use, requested once at the largest size asked."""
    sizes: dict = {}
    for index, chunk in enumerate(chunks):
        if chunk.valid < chunk.padded:
            sizes[GRADS_SUM] = max(sizes.get(GRADS_SUM, 0), 4 * chunk.padded)
        numel = dp * chunk.padded
        for hop, level in enumerate(levels):
            nbytes = level.size * segment_nbytes(numel // level.size, *formats[hop])
            for kind in ("send", "receive"):
                name = grads_hop(hop, kind, index)
                sizes[name] = max(sizes.get(name, 0), nbytes)
            numel //= level.size
    return {name: workspace.buffer(name, nbytes, device) for name, nbytes in sizes.items()}


def _hop(buffers: dict, index: int, hop: int, level: Level, numel: int, fmt) -> Hop:
    bits, group = fmt
    peers = level.size
    per_peer = numel // peers
    nbytes = peers * segment_nbytes(per_peer, bits, group)
    outgoing = buffers[grads_hop(hop, "send", index)][:nbytes]
    incoming = buffers[grads_hop(hop, "receive", index)][:nbytes]
    layout = segment_layout(per_peer, bits, group)
    scales = 4 * layout.groups
    return Hop(hop, level.name, peers, outgoing, incoming,
               wire_view(incoming, peers, per_peer, bits, group),
               (layout.codes_nbytes, scales, layout.nbytes - layout.codes_nbytes - scales,
                per_peer))


def _send_view(hop: Hop, fmt) -> QuantizedTensor:
    bits, group = fmt
    return wire_view(hop.outgoing, hop.peers, hop.sent_per_peer[3], bits, group)


def _write(last: Hop, dest: torch.Tensor, chunk: Chunk, block, buffers: dict) -> Callable:
    """Sum the last hop's pieces into the chunk's columns of the output; the shard's
    unaligned end is summed in fp32 first (the sum's padding is not the caller's)."""
    peers = last.peers
    if chunk.valid == chunk.padded:
        return quant.prepare("dequantize_sum", last.received, num_chunks=peers,
                             inverse_hadamard_block=block, out=dest)
    total = buffers[GRADS_SUM][: 4 * chunk.padded].view(torch.float32)
    summed = quant.prepare("dequantize_sum", last.received, num_chunks=peers,
                           inverse_hadamard_block=block, out=total)

    def write_valid_part(generator=None) -> None:
        summed()
        dest.copy_(total[: chunk.valid])

    return write_valid_part
