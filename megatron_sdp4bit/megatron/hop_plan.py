"""What the layer planned for this rank's collectives, in words: where the ranks run
and the hops of each data-parallel group's quantized reduce-scatter and weight gather.

The node layout comes from the hosts themselves (``comm/hosts.py``, gathered once at
install), so a run launched by srun, mpirun or torchrun says how many nodes it found;
a job taken for one node, or a group served by one flat level, shows in this line
rather than only in the bytes. Read at set-up, after megatron's DDP is built: every
topology is planned and cached by then, and only the cache is read (nothing here is
collective, so one rank may print it).
"""
from __future__ import annotations

from typing import List, Sequence

from megatron_sdp4bit.comm.host_layout import host_blocks
from megatron_sdp4bit.comm.layout import ONE_QUEUE_WHOLE_BUCKET_ELEMENTS
from megatron_sdp4bit.comm.topology import planned_topology, world_hosts

HOP_PLACES = {"intra": "inside a node", "inter": "across nodes"}


def describe_nodes(hosts: Sequence[str], ranks_per_node: int) -> str:
    """``2 hosts x 4 ranks (from the hosts)``, and the nodes planned inside them when
    ``ranks_per_node`` emulates smaller ones."""
    blocks = host_blocks(hosts)
    per_host = len(blocks[0][1])
    text = f"{len(blocks)} host{'s' if len(blocks) != 1 else ''} x {per_host} ranks (from the hosts)"
    if ranks_per_node != per_host:
        text += (f", planned as {len(hosts) // ranks_per_node} nodes of {ranks_per_node} "
                 "(--sdp4bit-ranks-per-node emulates nodes inside a host)")
    return text


def describe_hops(topology, config) -> str:
    """``8-bit inside a node (4 ranks), then 4-bit across nodes (2 ranks)``."""
    hops = [f"{config.grad_hop_format(level.name)[0]}-bit {HOP_PLACES[level.name]} ({level.size} ranks)"
            for level in topology.levels]
    text = ", then ".join(hops) or "one rank, nothing sent"
    if topology.fallback_reason:
        text += f" (one level: {topology.fallback_reason})"
    return text


def describe_gather(topology, config) -> str:
    """``4-bit across nodes (2 ranks), then inside a node (4 ranks)`` (``comm/gather_hops.py``),
    or ``4-bit, one all-gather over 8 ranks``."""
    bits = f"{config.weight_bits}-bit"
    if topology.is_two_level and config.weight_gather == "two-level":
        return (f"{bits} across nodes ({topology.num_nodes} ranks), "
                f"then inside a node ({topology.ranks_per_node} ranks)")
    return f"{bits}, one all-gather over {topology.dp_size} ranks"


# Where each runner runs the collectives megatron overlaps (comm/runner.py,
# comm/deferring_runner.py): the plan line, and background.py's INFO line for a runner
# --sdp4bit-runner names.
RUNNER_WORDS = {
    "inline": "not overlapped, run when megatron starts them",
    "thread": "on a worker thread",
    "stream": "on a CUDA side stream",
    "deferred": (f"each stage issued at megatron's next start or wait (one hardware queue; "
                 f"a bucket of up to {ONE_QUEUE_WHOLE_BUCKET_ELEMENTS >> 20} M elements in "
                 "one chunk, its buffers a whole bucket)"),
}


def describe_runner(state) -> str:
    """``stream runner: on a CUDA side stream``: where the collectives megatron overlaps
    run, once chosen (``megatron/background.py``), and whether ``--sdp4bit-runner`` chose it."""
    kind = state.runner.kind
    asked = " (--sdp4bit-runner)" if state.config.runner != "auto" else ""
    return f"{kind} runner{asked}: {RUNNER_WORDS.get(kind, kind)}"


def plan_lines(layer, model_chunks) -> List[str]:
    """This rank's plan: the nodes, where overlapped collectives run, then each distinct
    data-parallel group's hops (dense, then expert) of what the layer quantizes."""
    state, adapter, config = layer.state, layer.adapter, layer.state.config
    hosts = world_hosts()
    lines = []
    if hosts and config.ranks_per_node:
        lines.append(f"nodes: {describe_nodes(hosts, config.ranks_per_node)}")
    if not (config.quantize_grads or config.quantize_weights):
        return lines
    if state.runner_chosen:  # megatron overlaps them (--overlap-grad-reduce, --overlap-param-gather)
        lines.append(f"overlapped collectives: {describe_runner(state)}")
    seen = []
    for kind, groups_of in (("DP", adapter.ddp_bucket_groups), ("expert DP", adapter.expert_bucket_groups)):
        for chunk in model_chunks:
            if not hasattr(chunk, "bucket_groups"):  # not megatron's DDP: the layer does not serve it
                continue
            for bucket_group in groups_of(chunk):
                group, size, _rank = adapter.collective_group(bucket_group)
                if size == 1 or any(group is known for known in seen):
                    continue
                seen.append(group)
                topology = planned_topology(state.runner.group_for(group), config.ranks_per_node)
                for quantized, what, describe in ((config.quantize_grads, "gradient hops", describe_hops),
                                                  (config.quantize_weights, "weight gather", describe_gather)):
                    if quantized:
                        text = "not planned yet" if topology is None else describe(topology, config)
                        lines.append(f"{what}, {kind} {size}: {text}")
    return lines
