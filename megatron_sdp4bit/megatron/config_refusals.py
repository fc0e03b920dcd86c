"""Refusals: configurations the layer cannot quantize, and ranks that disagree.

Each runs once, where what it reads is fixed: at install or DDP construction, and for
an optimizer's own config at that optimizer's first step (the first point the layer
sees it; megatron builds it after DDP). A step only asks ``LayerState.refuse_once``,
which re-runs a DDP config's refusals when a second ``install()`` replaced the config
after the model was built.
"""
from __future__ import annotations

import torch

from megatron_sdp4bit.comm.backends import host_collective_device
from megatron_sdp4bit.config import SDP4BitConfig


def check_same_config_on_all_ranks(config: SDP4BitConfig) -> None:
    """All ranks must quantize alike; a mismatch raises on every rank (no hang)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    device = host_collective_device(None)
    mine = torch.tensor([config.fingerprint(), -config.fingerprint()], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    highest, lowest = mine.tolist()  # one-time check at set-up, not per step
    if highest != config.fingerprint() or -lowest != config.fingerprint():
        raise RuntimeError(
            "SDP4Bit configuration differs across ranks; every rank must be launched with the "
            f"same --sdp4bit* flags (this rank: {config.to_dict()})")


def check_ddp_config(adapter, ddp_config) -> None:
    """Raise when megatron is set up in a way the layer cannot quantize: what it does not
    support first (adding the distributed optimizer would not help there)."""
    unsupported = adapter.unsupported_ddp_features(ddp_config)
    if unsupported:
        raise RuntimeError(
            f"SDP4Bit does not support {', '.join(unsupported)} yet: turn "
            f"{'it' if len(unsupported) == 1 else 'them'} off, or drop the --sdp4bit flags")
    if not ddp_config.use_distributed_optimizer:
        raise RuntimeError(
            "SDP4Bit quantizes the distributed optimizer's reduce-scatter and all-gather: "
            "enable it with --use-distributed-optimizer (DistributedDataParallelConfig("
            "use_distributed_optimizer=True)), or drop the --sdp4bit flags")


def check_ddp_for(config: SDP4BitConfig, adapter, ddp_config) -> None:
    """Every refusal of a DDP config that ``config`` makes apply: the exact all-to-all's,
    then quantization's."""
    if config.exact_reduce_scatter == "alltoall":
        check_alltoall_ddp_config(adapter, ddp_config)
    if config.enabled:
        check_ddp_config(adapter, ddp_config)


def check_alltoall_ddp_config(adapter, ddp_config) -> None:
    """``exact_reduce_scatter="alltoall"`` replaces the distributed optimizer's
    reduce-scatter; without that optimizer megatron all-reduces, and the option would
    change nothing."""
    if not ddp_config.use_distributed_optimizer:
        raise RuntimeError(
            "--sdp4bit-exact-reduce-scatter alltoall (exact_reduce_scatter='alltoall') replaces the "
            "distributed optimizer's reduce-scatter: add --use-distributed-optimizer, or drop it")
    unsupported = adapter.unsupported_ddp_features(ddp_config)
    if unsupported:
        raise RuntimeError(
            f"--sdp4bit-exact-reduce-scatter alltoall does not support {', '.join(unsupported)}: "
            f"turn {'it' if len(unsupported) == 1 else 'them'} off, or drop it")


def check_host_staged_ddp(ddp_config) -> None:
    """gloo on CUDA tensors: the layer runs the exact bucket collectives itself, the
    distributed optimizer's reduce-scatter and all-gather, per bucket (grad_sync, param_sync)."""
    if not ddp_config.use_distributed_optimizer:
        raise RuntimeError(
            "--distributed-backend gloo on GPUs needs the distributed optimizer "
            "(--use-distributed-optimizer): megatron's coalesced gradient all-reduce cannot run "
            "on CUDA tensors over gloo")
    if ddp_config.num_distributed_optimizer_instances > 1:
        raise RuntimeError("--distributed-backend gloo on GPUs runs one distributed optimizer "
                           "instance: drop --num-distributed-optimizer-instances")


def check_model_config(model_config) -> None:
    """Model features the layer does not handle: CUDA graphs replay megatron's own
    bucket collectives and would bypass (or capture) the quantized ones."""
    graphs = getattr(model_config, "cuda_graph_impl", "none") not in (None, "none")
    if graphs or getattr(model_config, "enable_cuda_graph", False) \
            or getattr(model_config, "external_cuda_graph", False):
        raise RuntimeError("SDP4Bit does not support CUDA graphs (--cuda-graph-impl, "
                           "--enable-cuda-graph, --external-cuda-graph): turn them off, or drop "
                           "the --sdp4bit flags")


def check_optimizer_config(optimizer_config) -> None:
    """``overlap_param_gather_with_optimizer_step`` starts the first model chunk's
    all-gather from inside the chained optimizer's step, between its sub-optimizers'
    steps: a path the layer is not tested on, so it is refused rather than trusted."""
    if getattr(optimizer_config, "overlap_param_gather_with_optimizer_step", False):
        raise RuntimeError("SDP4Bit does not support --overlap-param-gather-with-optimizer-step: "
                           "drop it (keep --overlap-param-gather), or drop the --sdp4bit flags")
