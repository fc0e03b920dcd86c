"""Quantized gradient reduce-scatter: TLq-HS, TLq, ULq, and the exact passthrough.

Same contract as ``torch.distributed.reduce_scatter_tensor(output, input, op,
group, async_op)``: ``input`` holds ``P`` equal shards (P = DP size), and group
rank r receives in ``output`` shard r of the sum (or mean) over ranks.

Quantized path, per pipeline chunk (each chunk covers the same slice of every
shard):

1. quantize ``H(x / P or x)`` (Hadamard in blocks for TLq-HS) of the chunk's
   slices of all P shards taken in ``Topology.send_order`` (the layout that
   makes the two hops compose to a plain reduce-scatter), each zero-padded to
   the group-size alignment: one kernel reads the slices where they are
   (``quant.hadamard_quantize_rows``), and writes every peer's codes and scales
   into one buffer, which one all-to-all sends inside the node;
3. two levels only: dequantize the L received chunks, sum in fp32, requantize
   at the inter-node bits, all-to-all across nodes;
4. dequantize the received chunks, sum in fp32, inverse Hadamard, write the
   valid part into ``output``.

Chunk i+1's first hop is in flight while chunk i's second hop runs. A chunk
holds at most ``MAX_CHUNK_ELEMENTS`` (more chunks than ``pipeline_chunks`` where
needed), and chunks are launched one after another as earlier ones finish, so
the buffers are a few chunks' codes whatever the bucket size.

With ``async_op=True`` every stage of every chunk is handed to ``runner``
(``comm/runner.py``) at call time: a worker thread (gloo) or a side stream (NCCL)
runs them while the caller goes on, and only the handle's ``wait()`` joins the
caller with the result. The stages are the synchronous call's, in its order, so
the result is bit-identical to it (the same rounding draws in the same order).
The runner runs one collective after another, so a few chunks' buffers are alive
at a time, however many buckets are in flight. Without a runner the stages run
at call time on the caller.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.accounting import WireRecorder, recorder_or_default
from megatron_sdp4bit.comm.checks import check_float_tensors
from megatron_sdp4bit.comm.handles import finish_or_handle
from megatron_sdp4bit.comm.layout import (
    MAX_CHUNK_ELEMENTS,
    MIN_CHUNK_SHARD_ELEMENTS,
    Chunk,
    chunk_count,
    chunk_plan,
)
from megatron_sdp4bit.comm.primitives import all_to_all_equal, reduce_scatter_flat
from megatron_sdp4bit.comm.rng import pick_generator
from megatron_sdp4bit.comm.runner import Completion, run_or_submit
from megatron_sdp4bit.comm.topology import Level, Topology, get_topology, peer_split
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant import (
    QuantizedTensor,
    dequantize_sum,
    dequantize_sum_requantize,
    hadamard_quantize_rows,
    segment_layout,
    segment_nbytes,
    wire_view,
)

_COLLECTIVE = "reduce_scatter"



def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op=dist.ReduceOp.SUM,
    group=None,
    config: Optional[SDP4BitConfig] = None,
    async_op: bool = False,
    generator: Optional[torch.Generator] = None,
    workspace: Optional[Workspace] = None,
    recorder: Optional[WireRecorder] = None,
    runner=None,
) -> Optional[Completion]:
    """Reduce-scatter ``input`` into ``output`` over ``group`` as ``config.grad_mode`` says.

    ``op`` is ``ReduceOp.SUM`` or ``ReduceOp.AVG``. ``output`` may be this
    rank's own shard of ``input`` (Megatron passes the bucket's local shard):
    each chunk reads its columns of every shard before it writes those columns
    of the output, and chunks do not share columns. ``generator``
    overrides this rank's stochastic-rounding stream. ``workspace`` keeps the send
    and receive buffers for the next call (see ``comm/workspace.py`` for when one
    may be shared); without one they are allocated for this call. The bytes sent
    count into ``recorder`` (default ``comm.accounting.DEFAULT_RECORDER``). ``runner``
    (``comm/runner.py``) runs the collective's stages; with ``async_op`` they are
    submitted to it and the handle's ``wait()`` joins them. It must be the one runner
    that uses ``group`` and its subgroups while it runs. Returns None, or with
    ``async_op`` that handle.
    """
    config = config if config is not None else SDP4BitConfig()
    group = group if group is not None else dist.group.WORLD
    dp_size = dist.get_world_size(group)
    _validate(output, input, op, dp_size)
    shard = output.numel()
    element_size = input.element_size()
    same, other = peer_split(group, config.ranks_per_node)
    wire = recorder_or_default(recorder)
    wire.call(_COLLECTIVE)
    wire.peer_sends(_COLLECTIVE, same, other, exact=shard * element_size)
    if dp_size == 1 or shard == 0:
        return finish_or_handle(lambda: output.copy_(input.view(-1)[:shard].view_as(output)),
                                async_op)
    if not config.quantize_grads:
        wire.peer_sends(_COLLECTIVE, same, other, values=shard * element_size, elements=shard)
        as_alltoall = config.exact_reduce_scatter == "alltoall"
        if runner is None:  # torch's own async handle
            return reduce_scatter_flat(output, input, op, group, async_op, as_alltoall=as_alltoall)
        return run_or_submit(
            runner, lambda: reduce_scatter_flat(output, input, op, group, False, as_alltoall),
            async_op, (output, input))
    topology = get_topology(group, config.ranks_per_node)
    run = _QuantizedReduceScatter(output, input, op == dist.ReduceOp.AVG, topology, config,
                                  generator, workspace if workspace is not None else Workspace(),
                                  wire)
    # chunk by chunk: a few chunks' buffers alive at a time
    return run_or_submit(runner, run.finish, async_op, (output, input))


def _validate(output: torch.Tensor, input: torch.Tensor, op, dp_size: int) -> None:
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"op={op!r} is not supported; use ReduceOp.SUM or ReduceOp.AVG")
    check_float_tensors(input=input, output=output)
    if input.dtype != output.dtype or input.device != output.device:
        raise ValueError(f"input ({input.dtype}, {input.device}) and output "
                         f"({output.dtype}, {output.device}) must share dtype and device")
    if input.numel() != dp_size * output.numel():
        raise ValueError(
            f"input has {input.numel()} elements but must have DP size ({dp_size}) x "
            f"output ({output.numel()}) = {dp_size * output.numel()}"
        )


class _QuantizedReduceScatter:
    """State of one quantized reduce-scatter across its pipeline chunks.

    A chunk goes through up to three stages: quantize and start the first hop;
    (two levels) wait for it, sum, requantize and start the second hop; wait and
    write the output. Chunk i+1's hop is in flight while chunk i is summed. Each hop
    sends one buffer (every peer's codes and scales in one segment,
    ``quant.wire_view``), taken from ``workspace`` in two slots that the chunks
    use in turn: chunk i + 2 takes chunk i's, whose hops have completed by then.
    """

    def __init__(self, output, input, average, topology: Topology, config, generator,
                 workspace: Workspace, recorder: WireRecorder):
        self.output = output.view(-1)
        self.topology = topology
        self.config = config
        self.workspace = workspace
        self.recorder = recorder
        self.levels = topology.levels
        self.formats = [config.grad_hop_format(level.name) for level in self.levels]
        self.block = config.grad_hadamard_block
        align = config.grad_alignment([level.name for level in self.levels])
        self.shard = output.numel()
        chunks = chunk_count(self.shard, topology.dp_size, config.pipeline_chunks,
                             MAX_CHUNK_ELEMENTS, MIN_CHUNK_SHARD_ELEMENTS)
        self.unlaunched = deque(enumerate(chunk_plan(self.shard, align, chunks)))
        self.rows = input.view(topology.dp_size, self.shard)
        self.order = topology.send_order_index(input.device)
        self.scale = 1.0 / topology.dp_size if average else 1.0
        self.generator = pick_generator(generator, config.rounding, input.device, config.seed,
                                        topology.global_rank, "grads")
        self.first_hop: deque = deque()  # (chunk, first hop in flight)
        self.second_hop: deque = deque()  # (chunk, last hop in flight)

    # --- steps -------------------------------------------------------------------
    def finish(self) -> None:
        """Every remaining stage of every chunk, pipelined; the output is complete after."""
        while self.unlaunched:
            self._start_first_hop()
            self._advance(keep=1)  # the chunk just launched stays in flight
        self._advance(keep=0)
        while self.second_hop:
            self._write(*self.second_hop.popleft())

    def _start_first_hop(self) -> None:
        index, chunk = self.unlaunched.popleft()
        bits, group_size = self.formats[0]
        outgoing, send = self._send_buffer(index, 0, self.topology.dp_size * chunk.padded)
        hadamard_quantize_rows(self.rows, self.order, chunk.start, chunk.valid, chunk.padded,
                               bits=bits, group_size=group_size, hadamard_block=self.block,
                               rounding=self.config.rounding, generator=self.generator,
                               scale=self.scale, out=send)
        self.first_hop.append(((index, chunk), self._exchange(index, outgoing, send, 0)))

    def _advance(self, keep: int) -> None:
        """Move all but ``keep`` first-hop chunks on to their last hop, writing each
        chunk out once the next one's last hop is in flight."""
        while len(self.first_hop) > keep:
            (index, chunk), state = self.first_hop.popleft()
            if len(self.levels) == 1:  # the first hop was the last: write it now, so that
                self._write(chunk, state)  # its slot is free before chunk i + 2 takes it
                continue
            self.second_hop.append((chunk, self._second_hop(index, chunk, state)))
            while len(self.second_hop) > 1:
                self._write(*self.second_hop.popleft())

    def _second_hop(self, index: int, chunk: Chunk, state):
        """Sum the node's L pieces, requantize, start the inter-node hop."""
        bits, group_size = self.formats[1]
        numel = self.topology.dp_size * chunk.padded // self.levels[0].size
        outgoing, send = self._send_buffer(index, 1, numel)
        dequantize_sum_requantize(self._arrived(state), num_chunks=self.levels[0].size, bits=bits,
                                  group_size=group_size, rounding=self.config.rounding,
                                  generator=self.generator, out=send)
        return self._exchange(index, outgoing, send, 1)

    # --- helpers -----------------------------------------------------------------
    def _send_buffer(self, index: int, hop: int, numel: int):
        """Hop ``hop``'s send buffer for ``numel`` elements (bytes, and their wire view with
        one segment per peer), in the slot of chunk ``index``."""
        peers = self.levels[hop].size
        bits, group_size = self.formats[hop]
        nbytes = peers * segment_nbytes(numel // peers, bits, group_size)
        buffer = self.workspace.buffer(f"grads hop {hop} send {index % 2}", nbytes,
                                       self.rows.device)
        return buffer, wire_view(buffer, peers, numel // peers, bits, group_size)

    def _exchange(self, index: int, outgoing: torch.Tensor, send: QuantizedTensor, hop: int):
        """Start hop ``hop``'s all-to-all of ``outgoing`` (``send``'s bytes); record them."""
        level = self.levels[hop]
        bits, group_size = self.formats[hop]
        chunk_numel = send.numel // level.size
        incoming = self.workspace.buffer(f"grads hop {hop} receive {index % 2}",
                                         outgoing.numel(), self.rows.device)
        work = all_to_all_equal(incoming, outgoing, level.group)
        self._record(level, segment_layout(chunk_numel, bits, group_size), chunk_numel)
        return wire_view(incoming, level.size, chunk_numel, bits, group_size), work

    def _record(self, level: Level, layout, chunk_numel: int) -> None:
        if len(self.levels) == 1:  # a flat hop reaches peers on this node and others
            intra, inter = self.topology.same_node_peers, self.topology.other_node_peers
        else:
            intra, inter = (level.size - 1, 0) if level.name == "intra" else (0, level.size - 1)
        scales = 4 * layout.groups
        self.recorder.peer_sends(_COLLECTIVE, intra, inter, codes=layout.codes_nbytes,
                                 scales=scales, padding=layout.nbytes - layout.codes_nbytes - scales,
                                 elements=chunk_numel)

    @staticmethod
    def _arrived(state) -> QuantizedTensor:
        received, work = state
        work.wait()
        return received

    def _write(self, chunk: Chunk, state) -> None:
        received = self._arrived(state)
        peers = self.levels[-1].size
        dest = self.output[chunk.start: chunk.start + chunk.valid]
        if chunk.valid == chunk.padded:
            dequantize_sum(received, num_chunks=peers, inverse_hadamard_block=self.block, out=dest)
        else:  # the shard's unaligned end: the sum's padding is not the caller's
            total = self.workspace.buffer("grads sum", 4 * chunk.padded, self.rows.device)
            total = dequantize_sum(received, num_chunks=peers, inverse_hadamard_block=self.block,
                                   out=total.view(torch.float32))
            dest.copy_(total[: chunk.valid])
