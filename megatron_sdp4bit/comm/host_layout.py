"""Pure rules for the node layout the hosts themselves report (no torch.distributed).

``hosts[g]`` is the host identity of global rank ``g`` (``comm/hosts.py`` gathers it).
The two-level collectives assume that node ``g // L`` holds ranks ``[k*L, (k+1)*L)``:
every host holds the same number ``L`` of consecutive ranks. The rules here find ``L``
from the hosts, refuse a layout that breaks that assumption, and cross-check the
launcher's ``LOCAL_WORLD_SIZE`` and the ``--sdp4bit-ranks-per-node`` flag against it.
Every refusal is one line (a ValueError) naming the ranks and hosts.
"""
from __future__ import annotations

from typing import Optional, Sequence


def _span(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def host_blocks(hosts: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Runs of consecutive ranks on one host, in rank order: [(host, [ranks]), ...]."""
    blocks: list[tuple[str, list[int]]] = []
    for rank, host in enumerate(hosts):
        if blocks and blocks[-1][0] == host:
            blocks[-1][1].append(rank)
        else:
            blocks.append((host, [rank]))
    return blocks


def ranks_per_host(hosts: Sequence[str]) -> int:
    """``L``: the ranks each host holds, when every host holds the same number of
    consecutive ranks; else a one-line ValueError naming the ranks and hosts."""
    if not hosts:
        raise ValueError("no ranks: the host list is empty")
    blocks = host_blocks(hosts)
    seen: dict[str, list[int]] = {}
    for host, ranks in blocks:
        if host in seen:
            raise ValueError(
                f"host {host!r} holds ranks {_span(seen[host])} and {_span(ranks)}, not one run of "
                "consecutive ranks (a cyclic or interleaved placement): place ranks by node, e.g. "
                "srun --distribution=block, or torchrun's RANK order")
        seen[host] = ranks
    sizes = [len(ranks) for _host, ranks in blocks]
    if len(set(sizes)) > 1:
        spread = ", ".join(f"ranks {_span(ranks)} on {host!r}" for host, ranks in blocks)
        raise ValueError(
            f"hosts hold unequal numbers of ranks ({spread}): the two-level collectives need "
            "the same number of ranks on every node; start as many ranks on each node")
    return sizes[0]


def parse_local_world_size(value: Optional[str]) -> Optional[int]:
    """``LOCAL_WORLD_SIZE`` as an int, None when unset or empty; a one-line error when bad."""
    if not value:
        return None
    try:
        parsed = int(value)
    except ValueError:
        parsed = 0
    if parsed <= 0:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a positive integer; "
                         "fix the launcher, or give the ranks per node (--sdp4bit-ranks-per-node, or "
                         "ranks_per_node= of the config)")
    return parsed


def resolve_ranks_per_node(hosts: Sequence[str], local_world_size: Optional[int],
                           flag: Optional[int]) -> tuple[int, Optional[str]]:
    """(ranks per node to plan with, an INFO line or None) from the hosts' own layout.

    ``local_world_size`` (the launcher's) must equal ``L``; ``flag`` (the
    ``--sdp4bit-ranks-per-node`` / ``ranks_per_node`` of the config) must equal ``L`` or
    divide it: a divisor emulates nodes inside one host (tests, benchmarks), said in the
    INFO line. Anything else is a one-line ValueError naming both values.
    """
    per_host = ranks_per_host(hosts)
    num_hosts = len(hosts) // per_host
    if local_world_size is not None and local_world_size != per_host:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_world_size} but the hosts hold {per_host} ranks each "
            f"({num_hosts} host(s), {len(hosts)} ranks): fix the launcher, or set "
            "SDP4BIT_HOST_ID per emulated node")
    if flag is None or flag == per_host:
        return per_host, None
    if per_host % flag != 0:
        raise ValueError(
            f"--sdp4bit-ranks-per-node {flag} (ranks_per_node) neither equals nor divides the "
            f"{per_host} ranks on each of the {num_hosts} host(s) ({len(hosts)} ranks): give "
            f"{per_host} or a divisor of it, or leave it out")
    return flag, (f"--sdp4bit-ranks-per-node {flag} emulates {per_host // flag} nodes inside each of "
                  f"the {num_hosts} host(s) of {per_host} ranks (for tests and benchmarks)")
