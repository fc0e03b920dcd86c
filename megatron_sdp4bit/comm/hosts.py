"""Which host each rank runs on, learned from the hosts themselves.

A rank's host identity is ``SDP4BIT_HOST_ID`` when set (the documented override: tests
and benchmarks emulate nodes with it), else its hostname plus the kernel's boot id, so
that two containers with the same hostname on different machines differ. One object
all-gather over the world at install gives every rank every rank's identity.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

import torch.distributed as dist

HOST_ID_VARIABLE = "SDP4BIT_HOST_ID"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def _boot_id() -> Optional[str]:
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as handle:
            return handle.read().strip() or None
    except OSError:  # not Linux, or hidden by a sandbox: the hostname alone must do
        return None


def host_identity() -> str:
    """This process's host: ``SDP4BIT_HOST_ID``, else ``hostname`` or ``hostname/boot_id``."""
    override = os.environ.get(HOST_ID_VARIABLE)
    if override:
        return override
    boot = _boot_id()
    name = socket.gethostname()
    return f"{name}/{boot}" if boot else name


def gather_hosts(group=None) -> tuple[str, ...]:
    """Every member's host identity, in group-rank order. Collective over ``group``
    (default: the world); an object all-gather, done once at install."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_identity(), group=group)
    return tuple(str(host) for host in hosts)
