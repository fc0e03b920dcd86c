"""Process-group set-up for the driver: NCCL on CUDA, gloo + the CPU backend otherwise."""
from __future__ import annotations

import datetime
import os
import socket

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_minutes: float = 10.0) -> str:
    """Initialize torch.distributed from torchrun's variables (or as a single rank).

    Returns ``"cuda"`` or ``"cpu"``: the device the run uses. Without a GPU the
    run uses gloo and megatron_sdp4bit's CPU backend for megatron-core.
    """
    if "RANK" not in os.environ:  # plain `python -m ...`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from megatron_sdp4bit.megatron.cpu import enable_cpu_backend

        enable_cpu_backend()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return "cuda" if use_cuda else "cpu"


def init_model_parallel(seed: int) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def all_reduce_mean(value) -> float:
    """The mean over all ranks of a float or one-element tensor (reads it on the host)."""
    t = torch.tensor([float(value)], dtype=torch.float64,
                     device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def shutdown() -> None:
    if torch.distributed.is_initialized():
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        finally:
            torch.distributed.destroy_process_group()
