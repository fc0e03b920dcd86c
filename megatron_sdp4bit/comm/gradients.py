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
2. two levels only: dequantize the L received chunks, sum in fp32, requantize
   at the inter-node bits, all-to-all across nodes;
3. dequantize the received chunks, sum in fp32, inverse Hadamard, write the
   valid part into ``output``.

Chunk i+1's first hop is in flight while chunk i's second hop runs. A chunk
holds at most ``MAX_CHUNK_ELEMENTS`` (more chunks than ``pipeline_chunks`` where
needed; a bucket of up to a runner's ``whole_bucket_elements`` is one chunk), and
chunks are launched one after another as earlier ones finish, so the buffers are a
few chunks' codes whatever the bucket size.

On a worker thread (gloo) a call is a ``StagedJob`` (``comm/runner.py``): the next
call's chunk 0 is quantized and sent on its first hop while this call's last chunk
is still on its second hop, before this call's last write. Bucket after bucket, the
quantization of one then runs while the previous one's inter-node hop is on the
wire. The rounding draws keep their order (a write draws none) and the buffers
never meet: the next call's first stage uses first-hop buffers, the write waits on
a second hop's; one level has no second hop, and its call finishes before the next
starts.

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
from megatron_sdp4bit.comm.argument_checks import check_float_tensors
from megatron_sdp4bit.comm.handles import finish_or_handle
from megatron_sdp4bit.comm.layout import whole_bucket
from megatron_sdp4bit.comm.primitives import all_to_all_equal, reduce_scatter_flat
from megatron_sdp4bit.comm.reduce_scatter_plan import ReduceScatterPlan
from megatron_sdp4bit.comm.rounding_streams import pick_generator
from megatron_sdp4bit.comm.runner import Completion, StagedJob, run_or_submit
from megatron_sdp4bit.comm.topology import Topology, get_topology, peer_split
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig

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
    average = op == dist.ReduceOp.AVG
    space = workspace if workspace is not None else Workspace()
    whole = whole_bucket(input.numel(), runner.whole_bucket_elements if runner is not None else None)
    plan = space.plan(input, ("reduce_scatter", input.data_ptr(), output.data_ptr(), shard,
                              average, id(topology), config, whole),
                      lambda: ReduceScatterPlan(output, input, average, topology, config, space,
                                                whole))
    gen = pick_generator(generator, config.rounding, input.device, config.seed,
                         topology.global_rank, "grads")
    run = _QuantizedReduceScatter(plan, gen, wire, topology)
    # chunk by chunk: a few chunks' buffers alive at a time; on a thread runner the
    # next bucket's first quantization runs while this one's last hop is on the wire
    return run_or_submit(runner, StagedJob(run.start, run.launch_rest), async_op,
                         (output, input, *plan.buffers))


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
    """One quantized reduce-scatter run through its plan's chunks, pipelined.

    A chunk goes through up to three stages: quantize and start the first hop;
    (two levels) wait for it, sum, requantize and start the second hop; wait and
    write the output. Chunk i+1's hop is in flight while chunk i is summed. Each hop
    sends one buffer (every peer's codes and scales in one segment,
    ``quant.wire_view``), in two slots of the workspace that the chunks use in turn:
    chunk i + 2 takes chunk i's, whose hops have completed by then.
    """

    def __init__(self, plan: ReduceScatterPlan, generator, recorder: WireRecorder,
                 topology: Topology):
        self.plan = plan
        self.generator = generator
        self.recorder = recorder
        self.topology = topology
        self.first_hop: deque = deque()  # (chunk steps, first hop in flight)
        self.second_hop: deque = deque()  # (chunk steps, last hop in flight)

    def start(self) -> None:
        """Chunk 0: quantize and start its first hop (``StagedJob``'s head). It touches
        the first hop's slot-0 buffers only, which no earlier reduce-scatter's
        ``complete`` uses: that is a second hop's (and the output's)."""
        self._launch(self.plan.chunks[0])

    def launch_rest(self):
        """Every other stage up to the last chunk's last hop in flight; returns
        ``complete`` for two levels (what is left: wait and write the last chunk, no
        rounding draws), None for one level, whose last hop uses first-hop buffers
        that the next call's ``start`` takes: it finishes here."""
        for steps in self.plan.chunks[1:]:
            self._launch(steps)
        if self.plan.levels == 1:
            self.complete()
            return None
        self._advance(keep=0)  # every chunk on its last hop; all but the last written
        return self.complete

    def complete(self) -> None:
        """Wait for the hops in flight and write their chunks: the output is complete."""
        self._advance(keep=0)
        while self.second_hop:
            self._write(*self.second_hop.popleft())

    def _launch(self, steps) -> None:
        steps.quantize(self.generator)
        self.first_hop.append((steps, self._exchange(steps.hops[0])))
        self._advance(keep=1)  # the chunk just launched stays in flight

    def _advance(self, keep: int) -> None:
        """Move all but ``keep`` first-hop chunks on to their last hop, writing each
        chunk out once the next one's last hop is in flight."""
        while len(self.first_hop) > keep:
            steps, work = self.first_hop.popleft()
            if steps.requantize is None:  # the first hop was the last: write it now, so
                self._write(steps, work)  # that its slot is free before chunk i + 2 takes it
                continue
            work.wait()
            steps.requantize(self.generator)  # the node's L pieces summed, requantized
            self.second_hop.append((steps, self._exchange(steps.hops[1])))
            while len(self.second_hop) > 1:
                self._write(*self.second_hop.popleft())

    def _exchange(self, hop):
        """Start ``hop``'s all-to-all and record its bytes."""
        work = all_to_all_equal(hop.incoming, hop.outgoing, self.topology.levels[hop.index].group)
        if self.plan.levels == 1:  # a flat hop reaches peers on this node and others
            intra, inter = self.topology.same_node_peers, self.topology.other_node_peers
        else:
            intra, inter = (hop.peers - 1, 0) if hop.name == "intra" else (0, hop.peers - 1)
        codes, scales, padding, elements = hop.sent_per_peer
        self.recorder.peer_sends(_COLLECTIVE, intra, inter, codes=codes, scales=scales,
                                 padding=padding, elements=elements)
        return work

    @staticmethod
    def _write(steps, work) -> None:
        work.wait()
        steps.write()
