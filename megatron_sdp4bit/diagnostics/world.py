"""The process group a diagnostic or benchmark runs on: gloo, or NCCL on a cluster's GPUs.

``--backend`` of ``diagnostics.device_collectives`` and ``benchmarks.collectives``:

- ``gloo``: every rank on gloo; ranks may share a GPU (one GPU runs 4 ranks), CUDA
  tensors are staged through host memory. The CPU tests run this.
- ``nccl``: the world ``"cpu:gloo,cuda:nccl"`` (CUDA tensors over NCCL, what a
  training job uses; CPU tensors and object collectives over gloo, which the checks'
  CPU reference and result gathering need), each rank on ``cuda:LOCAL_RANK``. NCCL
  needs one GPU per rank, so a node must see at least as many GPUs as it runs ranks.
- ``auto`` (the default): ``nccl`` when CUDA is there and this node's ranks
  (``LOCAL_WORLD_SIZE``) are at least 2 and fit on its GPUs one each, else ``gloo``.

The choice and its refusals are pure functions of what the caller saw (CUDA, the
GPU count, the torchrun environment), so they are tested on CPU; ``start_world``
is the one place that calls ``init_process_group`` for these tools.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

BACKENDS = ("auto", "gloo", "nccl")
BACKEND_HELP = ("process group: gloo (ranks may share a GPU), nccl (one GPU per rank, "
                "world 'cpu:gloo,cuda:nccl', each rank on cuda:LOCAL_RANK), or auto "
                "(default: nccl when CUDA is there and this node's 2 or more ranks fit on "
                "its GPUs one each, else gloo)")


class WorldError(ValueError):
    """A backend this machine cannot serve; the message is one line saying what to change."""


@dataclass(frozen=True)
class Machine:
    """What the process group's choice depends on, as this rank saw it."""
    cuda_available: bool
    gpu_count: int
    local_rank: int
    local_world_size: int

    @classmethod
    def here(cls, env: Mapping[str, str]) -> "Machine":
        import torch

        cuda = torch.cuda.is_available()
        return cls(cuda_available=cuda, gpu_count=torch.cuda.device_count() if cuda else 0,
                   local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")))


def choose_backend(requested: str, machine: Machine, device_type: str = "cuda") -> str:
    """``gloo`` or ``nccl`` for ``requested`` on ``machine``; raises ``WorldError`` when
    ``nccl`` was asked for and cannot run. ``device_type`` is that of the checked tensors:
    NCCL serves CUDA tensors only."""
    if requested not in BACKENDS:
        raise WorldError(f"--backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "gloo":
        return "gloo"
    fits = (machine.cuda_available and device_type == "cuda"
            and machine.local_world_size <= machine.gpu_count)
    if requested == "auto":
        return "nccl" if fits and machine.local_world_size >= 2 else "gloo"
    if not machine.cuda_available:
        raise WorldError("--backend nccl needs CUDA, and torch sees none here: run it on the "
                         "GPU nodes, or use --backend gloo")
    if device_type != "cuda":
        raise WorldError("--backend nccl checks CUDA tensors: drop --device cpu, or use --backend gloo")
    if machine.local_world_size > machine.gpu_count:
        raise WorldError(f"--backend nccl needs one GPU per rank: this node runs "
                         f"{machine.local_world_size} ranks on {machine.gpu_count} visible GPU(s); "
                         f"set --nproc-per-node to at most {machine.gpu_count} (or check "
                         "CUDA_VISIBLE_DEVICES), or use --backend gloo")
    return "nccl"


def start_world(backend: str, machine: Machine):
    """Start the default process group for ``backend`` (``choose_backend``'s answer) and
    return the device this rank's CUDA tensors live on (``None`` for gloo: the caller
    chooses, since gloo ranks may share a GPU)."""
    import torch
    import torch.distributed as dist

    if backend == "gloo":
        dist.init_process_group("gloo")
        return None
    if machine.local_rank >= machine.gpu_count:
        raise WorldError(f"LOCAL_RANK {machine.local_rank} has no GPU of its own "
                         f"({machine.gpu_count} visible): use --backend gloo")
    device = torch.device("cuda", machine.local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    return device
