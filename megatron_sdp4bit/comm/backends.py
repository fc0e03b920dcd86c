"""Which backend serves a process group's collectives on tensors of one device.

A world started with ``init_process_group("cpu:gloo,cuda:nccl")`` (torch's default
when no backend is named) has one backend per device type, and
``dist.get_backend(group)`` names them all in one string. Deciding from that string
("is it gloo?") sends its CUDA tensors down gloo's host-staged path although NCCL
serves them. Every decision that depends on the backend asks ``backend_of(group,
device)`` instead: the name of the one backend that runs the collective.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def backend_for_device(backend_name: str, device_type: str) -> Optional[str]:
    """The backend ``backend_name`` (what ``dist.get_backend`` says: ``"gloo"``, or per device
    type ``"cpu:gloo,cuda:nccl"``) uses for ``device_type``; None when it names none for it."""
    name = backend_name.lower()
    if ":" not in name:  # one backend for every device type it can serve (NCCL: CUDA only)
        served = dist.Backend.backend_capability.get(name)
        return name if served is None or device_type in served else None
    for entry in name.split(","):
        device, _, backend = entry.strip().partition(":")
        if device == device_type:
            return backend
    return None


def backend_of(group, device) -> Optional[str]:
    """The name (``"gloo"``, ``"nccl"``, ...) of the backend that serves ``group``'s collectives on
    tensors of ``device``; ``group`` None is the default group. None when no backend of the
    group serves that device type."""
    group = group if group is not None else dist.group.WORLD
    device = torch.device(device)
    lookup = getattr(group, "_get_backend", None)  # the per-device lookup, where torch has it
    if lookup is not None:
        try:
            return str(lookup(device).name()).lower()
        except RuntimeError:  # "No backend type associated with device type ...": read the name below
            pass
    return backend_for_device(str(dist.get_backend(group)), device.type)


def host_collective_device(group) -> torch.device:
    """Where a small set-up collective over ``group`` (an agreement check) runs: on CPU
    tensors where a backend of the group serves them (gloo, or a mixed world's CPU
    backend), else on this process's CUDA device (an NCCL-only group)."""
    if backend_of(group, "cpu") is not None:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
