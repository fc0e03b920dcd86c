"""Bytes of the data-parallel collectives: what each rank sends, and what each link carries.

Two views of one collective call:

- ``Sent``: the bytes one rank sends, split intra/inter-node, exactly as
  ``megatron_sdp4bit.comm.accounting`` records them for the same call (each
  rank sends each peer its share once; padding included). The quantized sizes
  come from the same pieces the collectives use: ``SDP4BitConfig`` (bits,
  group sizes, Hadamard block, pipeline chunks), ``comm.layout.chunk_plan`` and
  ``lcm`` (padding), ``comm.layout.weight_slices``, ``quant.wire.segment_nbytes``
  (codes and fp32 scales of one peer, in one aligned segment),
  ``comm.layout.plan_node_layout`` (who is on which node).
  Tests compare these with the counters of real collectives.
- ``Links``: the bytes that actually cross each link, which depends on the
  algorithm: an all-to-all sends directly (link bytes = sent bytes), while a
  ring (NCCL's reduce-scatter and all-gather, gloo's all-gather) sends
  ``(P - 1)`` chunks from each rank to its ring successor only, so a node's
  network link carries one chain per ring instead of one message per remote
  peer. gloo's ``reduce_scatter`` is a ring all-reduce: twice a ring
  reduce-scatter (measured, docs/performance.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron_sdp4bit.comm.layout import (
    MAX_CHUNK_ELEMENTS,
    NodeLayout,
    chunk_count,
    chunk_plan,
    plan_node_layout,
    weight_slices,
)
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.estimate.implementation import THIS_PROJECT, Implementation
from megatron_sdp4bit.quant.wire import segment_nbytes


#: How the exact (unquantized) reduce-scatter moves its bytes.
EXACT_REDUCE_SCATTERS = {
    "ring": "ring reduce-scatter (NCCL): (P-1) shards from each rank to its ring successor",
    "alltoall": "all-to-all then local sum (comm/exact_alltoall.py): each shard straight to its owner",
    "allreduce": "ring all-reduce, shard kept (what gloo's reduce_scatter moves): twice the ring",
}


@dataclass(frozen=True)
class Sent:
    """Bytes one rank sends in one collective call (the accounting's convention)."""

    intra: int = 0
    inter: int = 0
    exact_intra: int = 0  # what the exact collective would send (the accounting's ``exact``)
    exact_inter: int = 0

    def __add__(self, other: "Sent") -> "Sent":
        return Sent(self.intra + other.intra, self.inter + other.inter,
                    self.exact_intra + other.exact_intra, self.exact_inter + other.exact_inter)

    @property
    def total(self) -> int:
        return self.intra + self.inter


def _peers(layout: NodeLayout, rank: int) -> Tuple[int, int]:
    same = layout.same_node_peers(rank)
    return same, layout.dp_size - 1 - same


def hop_levels(layout: NodeLayout) -> List[Tuple[str, int]]:
    """The all-to-all hops of a quantized reduce-scatter: [(level name, members)].

    As ``comm.topology``: two levels (L inside a node, then N across nodes)
    when the group spreads evenly over several nodes with several members
    each; else one flat level, ``intra`` when the whole group is on one node,
    ``inter`` otherwise (one member per node, or an uneven spread).
    """
    p = layout.dp_size
    if p == 1:
        return []
    if layout.is_two_level:
        return [("intra", layout.members_per_node), ("inter", layout.num_nodes)]
    if layout.num_nodes == 1 and layout.fallback_reason is None:
        return [("intra", p)]
    return [("inter", p)]


def _segment_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes one peer's part of a quantized message of ``numel`` elements takes on the wire:
    its codes, then its fp32 scales, each 16-byte aligned (``quant.wire``: every quantized
    hop and weight gather sends one buffer of such segments)."""
    return segment_nbytes(numel, bits, group_size)


@dataclass(frozen=True)
class HopBytes:
    """Per-peer bytes of one all-to-all hop of a quantized reduce-scatter, summed over chunks."""

    level: str
    members: int
    per_peer: int  # codes + scales sent to each peer of the hop


def grad_chunks(shard: int, layout: NodeLayout, config: SDP4BitConfig,
                impl: Implementation = THIS_PROJECT) -> list:
    """``comm.quantized_reduce_scatter``'s pipeline chunks of a shard (padding included):
    ``config.pipeline_chunks``, or more where a chunk over all shards would exceed the
    implementation's ``max_chunk_elements`` (``comm.layout.chunk_count``), unless its
    runner takes the bucket whole (``Implementation.takes_whole``)."""
    align = config.grad_alignment([level for level, _ in hop_levels(layout)])
    chunks = config.pipeline_chunks
    if impl.max_chunk_elements is not None:
        cap = (layout.dp_size * shard if impl.takes_whole(shard, layout.dp_size)
               else impl.max_chunk_elements)
        chunks = chunk_count(shard, layout.dp_size, chunks, max(1, cap),
                             impl.min_chunk_shard_elements)
    return chunk_plan(shard, align, chunks)


def quantized_reduce_scatter_hops(shard: int, layout: NodeLayout, config: SDP4BitConfig,
                                  impl: Implementation = THIS_PROJECT) -> List[HopBytes]:
    """The hops of ``comm.quantized_reduce_scatter`` for shards of ``shard`` elements."""
    levels = hop_levels(layout)
    if not levels or shard == 0:
        return []
    formats = [config.grad_hop_format(level) for level, _ in levels]
    p = layout.dp_size
    per_peer = [0] * len(levels)
    for chunk in grad_chunks(shard, layout, config, impl):
        numel = p * chunk.padded  # the first hop sends every shard's slice of the chunk
        for hop, ((_, members), (bits, group)) in enumerate(zip(levels, formats)):
            per_peer[hop] += _segment_nbytes(numel // members, bits, group)
            numel //= members  # the sum of the received pieces is requantized
    return [HopBytes(level, members, b) for (level, members), b in zip(levels, per_peer)]


def reduce_scatter_sent(shard: int, element_size: int, layout: NodeLayout, rank: int,
                        config: SDP4BitConfig, impl: Implementation = THIS_PROJECT) -> Sent:
    """What ``comm.quantized_reduce_scatter`` records for ``rank`` (shards of ``shard`` elements)."""
    same, other = _peers(layout, rank)
    exact = Sent(exact_intra=same * shard * element_size, exact_inter=other * shard * element_size)
    if layout.dp_size == 1 or shard == 0:
        return exact
    if not config.quantize_grads:
        return exact + Sent(intra=same * shard * element_size, inter=other * shard * element_size)
    hops = quantized_reduce_scatter_hops(shard, layout, config, impl)
    if len(hops) == 1:  # a flat hop reaches this rank's node and the others
        return exact + Sent(intra=same * hops[0].per_peer, inter=other * hops[0].per_peer)
    intra, inter = hops
    return exact + Sent(intra=(intra.members - 1) * intra.per_peer,
                        inter=(inter.members - 1) * inter.per_peer)


def all_gather_chunk(shard: int, element_size: int, config: SDP4BitConfig, dp: int,
                     impl: Implementation = THIS_PROJECT, whole: bool = False) -> int:
    """Bytes of one rank's contribution to the weight all-gather (values, or one segment of
    codes and scales per slice: ``whole`` for an overlapped gather of the whole shard, else
    the slices of a synchronous one where the implementation slices it)."""
    if not config.quantize_weights:
        return shard * element_size
    whole = whole or not impl.sliced_weight_gather or impl.takes_whole(shard, dp)
    slices = weight_slices(shard, dp, config.weight_group_size, whole, impl.max_chunk_elements
                           or MAX_CHUNK_ELEMENTS, impl.min_slice_elements)
    return sum(_segment_nbytes(n, config.weight_bits, config.weight_group_size) for _, n in slices)


def two_level_gather(layout: NodeLayout, config: SDP4BitConfig, impl: Implementation) -> bool:
    """Whether the weight all-gather runs in two hops (``comm/gather_hops.py``)."""
    return (impl.two_level_weight_gather and config.quantize_weights
            and config.weight_gather == "two-level" and len(hop_levels(layout)) == 2)


def all_gather_sent(shard: int, element_size: int, layout: NodeLayout, rank: int,
                    config: SDP4BitConfig, impl: Implementation = THIS_PROJECT) -> Sent:
    """What ``comm.quantized_all_gather_weights`` records for ``rank`` (``element_size``:
    the model buffer's): flat, its segments to every peer; two levels, to its counterpart
    on each other node, then its node's segments to each peer on its node."""
    same, other = _peers(layout, rank)
    exact = Sent(exact_intra=same * shard * element_size, exact_inter=other * shard * element_size)
    if layout.dp_size == 1 or shard == 0:
        return exact
    chunk = all_gather_chunk(shard, element_size, config, layout.dp_size, impl)
    if two_level_gather(layout, config, impl):
        nodes = layout.num_nodes
        return exact + Sent(intra=(layout.members_per_node - 1) * nodes * chunk,
                            inter=(nodes - 1) * chunk)
    return exact + Sent(intra=same * chunk, inter=other * chunk)


# --- what the links carry ------------------------------------------------------------

@dataclass
class Links:
    """Bytes on the links during one phase, for all DP groups at once.

    ``gpu_intra[g]``: bytes global rank g sends over its intra-node links;
    ``node_inter[n]``: bytes node n sends over its network links (all its
    ranks together, one direction; the phases are symmetric);
    ``node_streams[n]``: independent senders of those bytes (``network.py``):
    one per ring crossing out of the node, one per GPU sending in an all-to-all.
    """

    gpu_intra: Dict[int, int]
    node_inter: Dict[int, int]
    node_streams: Dict[int, int]

    @staticmethod
    def empty() -> "Links":
        return Links({}, {}, {})

    def add_gpu(self, rank: int, nbytes: int) -> None:
        self.gpu_intra[rank] = self.gpu_intra.get(rank, 0) + nbytes

    def add_node(self, node: int, nbytes: int, streams: int = 1) -> None:
        self.node_inter[node] = self.node_inter.get(node, 0) + nbytes
        self.node_streams[node] = self.node_streams.get(node, 0) + streams

    def merge(self, other: "Links", concurrent: bool = True) -> None:
        """Add ``other``'s bytes; its streams add when it runs at the same time as these
        (another DP group), else (the next bucket of the same group) the larger count holds."""
        for rank, n in other.gpu_intra.items():
            self.add_gpu(rank, n)
        for node, n in other.node_inter.items():
            streams = other.node_streams.get(node, 0)
            self.add_node(node, n, streams if concurrent else 0)
            if not concurrent:
                self.node_streams[node] = max(self.node_streams[node], streams)

    @property
    def max_gpu_intra(self) -> int:
        return max(self.gpu_intra.values(), default=0)

    @property
    def max_node_inter(self) -> int:
        return max(self.node_inter.values(), default=0)


def ring_links(layout: NodeLayout, ranks_in_order: Sequence[int], per_step: int,
               rounds: int = 1) -> Links:
    """A ring over ``ranks_in_order``: each rank sends ``rounds * (P-1) * per_step`` bytes
    to its successor, over an intra-node link or its node's network link."""
    links = Links.empty()
    p = len(ranks_in_order)
    if p < 2 or per_step == 0:
        return links
    rpn = layout.physical_ranks_per_node
    for i, rank in enumerate(ranks_in_order):
        nxt = ranks_in_order[(i + 1) % p]
        nbytes = rounds * (p - 1) * per_step
        if rank // rpn == nxt // rpn:
            links.add_gpu(rank, nbytes)
        else:
            links.add_node(rank // rpn, nbytes)
    return links


def direct_links(layout: NodeLayout, sent_of_rank) -> Links:
    """Point-to-point sends (all-to-all hops): each rank's accounted bytes go straight out."""
    links = Links.empty()
    rpn = layout.physical_ranks_per_node
    for rank in layout.ranks:
        sent: Sent = sent_of_rank(rank)
        if sent.intra:
            links.add_gpu(rank, sent.intra)
        if sent.inter:
            links.add_node(rank // rpn, sent.inter)
    return links


@dataclass
class PhaseLinks:
    """Link bytes of one collective call, per phase (an all-to-all hop or a whole ring)."""

    phases: List[Tuple[str, Links]]  # (description, links); phases run one after another
    pipelined: int = 1  # chunks overlapping consecutive hops (quantized reduce-scatter)


def reduce_scatter_links(shard: int, element_size: int, layout: NodeLayout,
                         config: SDP4BitConfig, exact_algorithm: str,
                         impl: Implementation = THIS_PROJECT) -> PhaseLinks:
    """Link bytes of one gradient reduce-scatter over one DP group (every member at once)."""
    if layout.dp_size == 1 or shard == 0:
        return PhaseLinks([])
    if not config.quantize_grads:
        if exact_algorithm == "alltoall":
            return PhaseLinks([("all-to-all", direct_links(
                layout, lambda r: reduce_scatter_sent(shard, element_size, layout, r, config)))])
        rounds = {"ring": 1, "allreduce": 2}[exact_algorithm]
        return PhaseLinks([(exact_algorithm, ring_links(layout, layout.ranks,
                                                        shard * element_size, rounds))])
    hops = quantized_reduce_scatter_hops(shard, layout, config, impl)
    rpn = layout.physical_ranks_per_node
    phases = []
    for hop in hops:
        links = Links.empty()
        for rank in layout.ranks:
            if len(hops) == 1:
                same, other = _peers(layout, rank)
            else:
                same, other = ((hop.members - 1, 0) if hop.level == "intra"
                               else (0, hop.members - 1))
            if same:
                links.add_gpu(rank, same * hop.per_peer)
            if other:
                links.add_node(rank // rpn, other * hop.per_peer)
        phases.append((f"{hop.level} all-to-all", links))
    return PhaseLinks(phases, pipelined=len(grad_chunks(shard, layout, config, impl)))


def all_gather_links(shard: int, element_size: int, layout: NodeLayout,
                     config: SDP4BitConfig, impl: Implementation = THIS_PROJECT) -> PhaseLinks:
    """Link bytes of one weight all-gather: a ring, as NCCL's and gloo's all-gather; two
    levels, a ring across nodes in each local index's group (all at once), then a ring
    of the node's segments inside each node."""
    if layout.dp_size == 1 or shard == 0:
        return PhaseLinks([])
    chunk = all_gather_chunk(shard, element_size, config, layout.dp_size, impl)
    if not two_level_gather(layout, config, impl):
        return PhaseLinks([("ring all-gather", ring_links(layout, layout.ranks, chunk))])
    phases = []
    for name, groups, per_step in (
            ("ring all-gather across nodes", layout.inter_members(), chunk),
            ("ring all-gather inside the node", layout.intra_members(),
             layout.num_nodes * chunk)):
        links = Links.empty()
        for members in groups:
            links.merge(ring_links(layout, members, per_step))
        phases.append((name, links))
    return PhaseLinks(phases)


def embedding_allreduce_links(first_last: Sequence[Tuple[int, int]], numel: int,
                              element_size: int, gpus_per_node: int) -> Links:
    """Megatron's all-reduce of the tied word embeddings' gradients between the first and
    the last pipeline stage (``finalize_model_grads``), all (first, last) rank pairs at once:
    a ring of two, each rank sends its whole gradient once."""
    links = Links.empty()
    nbytes = numel * element_size
    for pair in first_last:
        for rank, peer in (pair, pair[::-1]):
            if rank // gpus_per_node == peer // gpus_per_node:
                links.add_gpu(rank, nbytes)
            else:
                links.add_node(rank // gpus_per_node, nbytes)
    return links


# --- the DP groups of a Megatron world -----------------------------------------------

def megatron_dp_groups(world: int, tp: int, pp: int) -> List[Tuple[int, List[int]]]:
    """[(pipeline stage, DP group ranks)] of Megatron's default order ``tp-cp-ep-dp-pp``
    (TP fastest, then DP, then PP; context and expert parallelism 1)."""
    dp = world // (tp * pp)
    return [(stage, [t + tp * (d + dp * stage) for d in range(dp)])
            for stage in range(pp) for t in range(tp)]


def dp_layouts(nodes: int, gpus_per_node: int, tp: int, pp: int) -> List[Tuple[int, NodeLayout]]:
    """[(stage, NodeLayout)] of every DP group of a ``nodes x gpus_per_node`` Megatron world."""
    return [(stage, plan_node_layout(ranks, gpus_per_node))
            for stage, ranks in megatron_dp_groups(nodes * gpus_per_node, tp, pp)]
