"""Intra- and inter-node subgroups of a data-parallel group.

``get_topology(group, ranks_per_node)`` describes how the collectives reach
``group``'s members: one flat level (one node, one member per node, or an
uneven spread) or two levels (an all-to-all inside each node, then one across
nodes). Results are cached per (group, ranks_per_node).

Creating process groups is collective over the whole world:
``torch.distributed.new_group`` must be called by *every* rank, in the same
order, for every group, members or not. Hence:

- a DP group that spans the whole world builds its subgroups on the first
  ``get_topology`` call (every rank makes that call);
- when the world holds several DP groups (tensor or pipeline parallelism),
  every rank must first call ``build_topologies(all_dp_rank_lists)`` with the
  rank lists of *all* DP groups, in the same order everywhere. A two-level
  group asked for without that raises an error instead of hanging.

Both paths first check, with one small all-gather, that all ranks agree on
``ranks_per_node`` (and on the rank lists), so a disagreement raises the same
ValueError on every rank rather than mismatched groups.

``ranks_per_node`` None means the layout the hosts report (``default_ranks_per_node``):
the first such call gathers every rank's host over the world (``comm/hosts.py``), so
every rank makes it, as with the first call for the world group.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.backends import host_collective_device
from megatron_sdp4bit.comm.host_layout import parse_local_world_size, resolve_ranks_per_node
from megatron_sdp4bit.comm.hosts import gather_hosts
from megatron_sdp4bit.comm.layout import NodeLayout, plan_node_layout, two_level_send_order

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_SUBGROUPS: dict = {}  # (sorted members tuple) -> ProcessGroup, only groups this rank is in
_BUILT_LAYOUTS: set = set()  # (sorted DP ranks, ranks_per_node) whose subgroups exist
_TOPOLOGIES: dict = {}  # (group, ranks_per_node, strict) -> Topology
_WARNED: set = set()
_LAYOUTS: dict = {}  # (DP ranks in group order, ranks_per_node) -> NodeLayout
_PRIVATE: dict = {}  # sorted members -> a group of them only a runner's worker uses (or None)
_HOSTS: dict = {}  # "world" -> every global rank's host identity (gathered once)


@dataclass(frozen=True, eq=False)
class Level:
    """One all-to-all hop: its process group, member count, and wire label."""

    name: str  # "intra" or "inter": which bit width and counter it uses
    group: object
    size: int


@dataclass(frozen=True, eq=False)
class Topology:
    """How this rank reaches the other members of its DP group.

    ``num_nodes``, ``ranks_per_node``, ``node_index`` and ``local_rank``
    describe the hierarchy the collectives *use*: after a fallback it is
    ``dp_size`` nodes of one rank each. ``intra_group``/``inter_group`` are
    None when that level has one member; for a single-level topology the
    remaining level is the DP group itself.
    """

    group: object
    ranks: tuple[int, ...]  # global ranks in DP-group order
    group_rank: int
    global_rank: int
    layout: NodeLayout
    num_nodes: int
    ranks_per_node: int
    node_index: int
    local_rank: int
    intra_group: Optional[object]
    inter_group: Optional[object]
    send_order: tuple[int, ...]  # DP shard in each slot of the first hop's buffer
    fallback_reason: Optional[str]
    _order_on_device: dict = field(default_factory=dict, repr=False)

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def is_two_level(self) -> bool:
        return self.intra_group is not None and self.inter_group is not None

    @property
    def levels(self) -> tuple[Level, ...]:
        """The all-to-all hops of a reduce-scatter, in order (empty for one rank)."""
        hops = []
        if self.intra_group is not None:
            hops.append(Level("intra", self.intra_group, self.ranks_per_node))
        if self.inter_group is not None:
            hops.append(Level("inter", self.inter_group, self.num_nodes))
        return tuple(hops)

    def send_order_index(self, device) -> Optional[torch.Tensor]:
        """``send_order`` as a long tensor on ``device`` (None when it is the identity),
        built once per device: on a GPU, building it from the tuple is a blocking
        host-to-device copy, which inside every reduce-scatter would stall the
        backward pass once per bucket."""
        if self.send_order == tuple(range(len(self.send_order))):
            return None
        key = str(device)
        index = self._order_on_device.get(key)
        if index is None:
            index = torch.tensor(self.send_order, dtype=torch.long, device=device)
            self._order_on_device[key] = index
        return index

    @property
    def same_node_peers(self) -> int:
        """DP peers on this rank's physical node (for the intra/inter byte split)."""
        return self.layout.same_node_peers(self.global_rank)

    @property
    def other_node_peers(self) -> int:
        return self.dp_size - 1 - self.same_node_peers


def default_ranks_per_node(ranks_per_node: Optional[int] = None) -> int:
    """The ranks per node to plan with, from where the ranks really run.

    Each rank's host comes from the hosts themselves (``comm/hosts.py``: one object
    all-gather over the world, the first time; collective, so every rank calls it, as
    the layer does at install). ``LOCAL_WORLD_SIZE`` and ``ranks_per_node`` (the
    ``--sdp4bit-ranks-per-node`` flag) only cross-check it; a divisor of the ranks per
    host emulates nodes inside a host. The rules, and their one-line refusals, are
    ``comm/host_layout.py``'s.
    """
    local = parse_local_world_size(os.environ.get("LOCAL_WORLD_SIZE"))
    with _LOCK:
        if "world" not in _HOSTS:
            _HOSTS["world"] = gather_hosts()
        hosts = _HOSTS["world"]
    value, note = resolve_ranks_per_node(hosts, local, ranks_per_node)
    if note is not None and dist.get_rank() == 0:
        logger.info("%s", note)
    return value


def world_hosts() -> Optional[tuple]:
    """Every global rank's host identity, once ``default_ranks_per_node`` has gathered
    them (None before)."""
    with _LOCK:
        return _HOSTS.get("world")


def _resolve_ranks_per_node(ranks_per_node: Optional[int]) -> int:
    """The value to plan with: as given (checked by ``plan_node_layout``, its one rule), or
    when None the layout the hosts report (``default_ranks_per_node``)."""
    return default_ranks_per_node() if ranks_per_node is None else ranks_per_node


def _check_agreement(group, what: str, value: int, description: str) -> None:
    """All-gather ``value`` over ``group``; raise the same ValueError everywhere if ranks differ."""
    local = torch.tensor([value], dtype=torch.int64, device=host_collective_device(group))
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    values = [int(t.item()) for t in gathered]
    if len(set(values)) > 1:
        raise ValueError(
            f"ranks disagree on {what} ({description} on this rank; per-rank values "
            f"{values}). Every rank must pass the same arguments, e.g. set ranks_per_node "
            "explicitly instead of relying on LOCAL_WORLD_SIZE on uneven machines"
        )


def _fingerprint(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def _new_subgroup(members: tuple[int, ...]):
    """Create (collectively, on every rank) or reuse a subgroup; None if not a member."""
    if members in _SUBGROUPS:
        return _SUBGROUPS[members]
    group = dist.new_group(ranks=list(members))
    if dist.get_rank() in members:
        _SUBGROUPS[members] = group
        return group
    _SUBGROUPS.setdefault(members, None)
    return None


def _create_subgroups(layout: NodeLayout) -> None:
    """new_group for every intra- and inter-node group of a two-level layout (all ranks call)."""
    key = (tuple(sorted(layout.ranks)), layout.physical_ranks_per_node)
    if key in _BUILT_LAYOUTS:
        return
    if layout.is_two_level:
        for members in layout.intra_members() + layout.inter_members():
            _new_subgroup(members)
    _BUILT_LAYOUTS.add(key)


def build_topologies(all_dp_rank_lists: Sequence[Sequence[int]],
                     ranks_per_node: Optional[int] = None, strict: bool = False) -> None:
    """Create the subgroups of every DP group at once. Collective over the world.

    Every rank calls it with the same lists in the same order (e.g. Megatron's
    DP groups, one list per group). Afterwards ``get_topology(dp_group)`` works
    on every rank without further collectives. With ``strict`` a group spread
    unevenly over the nodes (which ``get_topology`` would serve with one flat level)
    raises ValueError on every rank, naming its ranks' hosts.
    """
    with _LOCK:
        rpn = _resolve_ranks_per_node(ranks_per_node)
        lists = [tuple(int(r) for r in ranks) for ranks in all_dp_rank_lists]
        _check_agreement(None, "build_topologies arguments (fingerprints)",
                         _fingerprint(rpn, lists), f"ranks_per_node={rpn}, DP groups {lists}")
        layouts = [plan_node_layout(ranks, rpn) for ranks in lists]
        uneven = [layout for layout in layouts if layout.fallback_reason is not None]
        if strict and uneven:  # every rank planned the same layouts: all gather, all raise
            hosts = gather_hosts()
            on = {}
            for rank in sorted(uneven[0].ranks):
                on.setdefault(hosts[rank], []).append(rank)
            raise ValueError(
                f"DP group {sorted(uneven[0].ranks)} spreads unevenly over nodes of {rpn} ranks "
                f"(DP members per node: {[len(n) for n in uneven[0].nodes]}; hosts: " + "; ".join(
                    f"{host}: ranks {', '.join(map(str, ranks))}" for host, ranks in on.items())
                + "): a two-level collective needs the same number on every node. Give "
                "--sdp4bit-ranks-per-node 1 (ranks_per_node=1: one flat level), or tensor, "
                "pipeline and expert parallel sizes that put as many members of every "
                "data-parallel group on each node")
        for layout in layouts:
            _create_subgroups(layout)


def build_private_groups(all_dp_rank_lists: Sequence[Sequence[int]]) -> None:
    """For every listed group, a process group of the same members that nothing but one
    worker thread uses (``private_group``). Collective over the world: every rank calls
    it with the same lists in the same order. Groups made earlier are kept."""
    with _LOCK:
        for ranks in all_dp_rank_lists:
            members = tuple(sorted(int(r) for r in ranks))
            if members in _PRIVATE:
                continue
            group = dist.new_group(ranks=list(members))
            _PRIVATE[members] = group if dist.get_rank() in members else None


def private_group(group):
    """The private twin of ``group`` (``build_private_groups``). Its collectives pair only
    with one another, so a worker thread may run them beside the caller's own collectives
    on ``group`` (two threads issuing collectives on one gloo group may pair them wrongly).
    Its rank order is ``group``'s: torch orders every group's ranks by global rank."""
    ranks = tuple(dist.get_process_group_ranks(group))
    with _LOCK:
        twin = _PRIVATE.get(tuple(sorted(ranks)))
    if twin is None:
        raise RuntimeError(f"no private process group was built for the group of ranks {list(ranks)}: "
                           "call megatron_sdp4bit.comm.topology.build_private_groups on every rank first")
    if tuple(dist.get_process_group_ranks(twin)) != ranks:
        raise RuntimeError(f"the group of ranks {list(ranks)} is not ordered by global rank, so a "
                           "private twin cannot stand in for it")
    return twin


def get_topology(group=None, ranks_per_node: Optional[int] = None,
                 strict: bool = False) -> Topology:
    """The (cached) topology of ``group`` (default: the world) on this rank.

    ``ranks_per_node`` defaults to the hosts' own layout (``default_ranks_per_node``). An uneven spread over
    nodes falls back to one flat level with a logged warning, or raises
    ValueError when ``strict``. The first call for a group is collective over
    that group (and over the world when it builds subgroups).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    with _LOCK:
        rpn = _resolve_ranks_per_node(ranks_per_node)
        key = (group, rpn, strict)
        if key not in _TOPOLOGIES:
            _TOPOLOGIES[key] = _make_topology(group, rpn, strict)
        return _TOPOLOGIES[key]


def planned_topology(group, ranks_per_node: int, strict: bool = False) -> Optional[Topology]:
    """``get_topology``'s cached answer for ``group``, or None when it was never asked:
    never collective, so a reader on one rank (a log line) cannot make a collective
    the other ranks do not."""
    with _LOCK:
        return _TOPOLOGIES.get((group, ranks_per_node, strict))


def _make_topology(group, rpn: int, strict: bool) -> Topology:
    ranks = tuple(dist.get_process_group_ranks(group))
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of the DP group {list(ranks)}")
    _check_agreement(group, "ranks_per_node", rpn, f"ranks_per_node={rpn}")
    layout = plan_node_layout(ranks, rpn)
    if layout.fallback_reason is not None:
        if strict:
            raise ValueError(layout.fallback_reason)
        if layout.fallback_reason not in _WARNED:
            _WARNED.add(layout.fallback_reason)
            if me == ranks[0]:  # every member decides alike (agreement checked above): one says it
                logger.warning("%s; using one flat all-to-all level instead.", layout.fallback_reason)
    if layout.is_two_level:
        return _two_level(group, ranks, me, layout)
    return _single_level(group, ranks, me, layout)


def _single_level(group, ranks, me, layout: NodeLayout) -> Topology:
    p = len(ranks)
    position = ranks.index(me)
    one_node = layout.num_nodes == 1 and layout.fallback_reason is None
    if one_node:  # every member on this node: the flat level is intra-node
        shape = dict(num_nodes=1, ranks_per_node=p, node_index=0, local_rank=position,
                     intra_group=group if p > 1 else None, inter_group=None)
    else:  # one member per node, or a fallback: P "nodes" of one rank
        node_index = layout.node_of(me) if layout.fallback_reason is None else position
        shape = dict(num_nodes=p, ranks_per_node=1, node_index=node_index, local_rank=0,
                     intra_group=None, inter_group=group)
    return Topology(group=group, ranks=ranks, group_rank=position, global_rank=me,
                    layout=layout, send_order=tuple(range(p)),
                    fallback_reason=layout.fallback_reason, **shape)


def _two_level(group, ranks, me, layout: NodeLayout) -> Topology:
    key = (tuple(sorted(ranks)), layout.physical_ranks_per_node)
    if key not in _BUILT_LAYOUTS:
        if set(ranks) != set(range(dist.get_world_size())):
            raise RuntimeError(
                f"the subgroups of DP group {sorted(ranks)} (ranks_per_node="
                f"{layout.physical_ranks_per_node}) were not built: call "
                "megatron_sdp4bit.comm.build_topologies(all_dp_rank_lists, ranks_per_node) "
                "on every rank before the first quantized collective"
            )
        _create_subgroups(layout)
    node_index = layout.node_of(me)
    local_rank = layout.nodes[node_index].index(me)
    intra = _SUBGROUPS[layout.nodes[node_index]]
    inter = _SUBGROUPS[layout.inter_members()[local_rank]]
    # The send order assumes group rank == local index (intra) and == node index (inter).
    if dist.get_rank(intra) != local_rank or dist.get_rank(inter) != node_index:
        raise RuntimeError("torch.distributed ordered a subgroup unexpectedly; "
                           "subgroup ranks must follow sorted global ranks")
    return Topology(group=group, ranks=ranks, group_rank=ranks.index(me), global_rank=me,
                    layout=layout, num_nodes=layout.num_nodes,
                    ranks_per_node=layout.members_per_node, node_index=node_index,
                    local_rank=local_rank, intra_group=intra, inter_group=inter,
                    send_order=two_level_send_order(layout, ranks), fallback_reason=None)


def reset_topology_cache() -> None:
    """Forget cached topologies (subgroups already created are kept and reused)."""
    with _LOCK:
        _TOPOLOGIES.clear()


def forget_subgroups() -> None:
    """Drop every reference this process holds to the subgroups it made; call it before
    ``torch.distributed.destroy_process_group()``. A process group still referenced when
    the interpreter exits is destroyed during its teardown, where gloo's worker threads
    can abort the process ("terminate called without an active exception", seen in 1 of
    4 exits of a 4-rank job): the job then fails after it has finished."""
    with _LOCK:
        _TOPOLOGIES.clear()
        _SUBGROUPS.clear()
        _BUILT_LAYOUTS.clear()
        _LAYOUTS.clear()
        _PRIVATE.clear()
        _HOSTS.clear()


def peer_split(group=None, ranks_per_node: Optional[int] = None) -> tuple[int, int]:
    """(peers on this rank's node, peers elsewhere) in ``group``; no collective involved,
    except that with ``ranks_per_node`` None the hosts are gathered over the world if no
    call before did (the layer resolves ``ranks_per_node`` at install, so it never does).

    Used to split the bytes of flat collectives (all-gathers, exact
    reduce-scatters) between the intra and inter counters.
    """
    group = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    rpn = _resolve_ranks_per_node(ranks_per_node)
    layout = _cached_layout(ranks, rpn)
    same = layout.same_node_peers(dist.get_rank())
    return same, len(ranks) - 1 - same


def _cached_layout(ranks: tuple[int, ...], rpn: int) -> NodeLayout:
    key = (ranks, rpn)
    with _LOCK:
        if key not in _LAYOUTS:
            _LAYOUTS[key] = plan_node_layout(ranks, rpn)
        return _LAYOUTS[key]
