"""The torch.distributed calls the collectives make, and which way each one goes.

Three primitives carry every byte the quantized collectives send: an all-gather
into one tensor, an all-to-all of equal chunks, and (for the exact paths) a
reduce-scatter; the patch layer's exact gradient path adds an all-reduce. Each takes its tensors and process group as torch's call does
and picks the path from them, so nothing above has to know the backend:

- NCCL on CUDA tensors, gloo on CPU tensors: torch's own call.
- gloo on CUDA tensors (``--distributed-backend gloo`` on GPUs: several ranks
  sharing a GPU, which NCCL refuses). torch's gloo copies CUDA tensors through
  pinned host memory for all-to-all, all-gather, all-reduce and broadcast, and
  those run as they are. Its reduce-scatter is not one (in the releases read for
  this, an all-reduce of a clone of the whole input, and one of them passes no
  reduce op to it: AVG becomes SUM). So on gloo + CUDA the reduce-scatter is an
  all-to-all plus a local fp32 sum (``exact_alltoall``): exact for SUM and AVG
  on every release, and it sends each peer one shard, as a ring does.

``runs_on_host_staged_gloo`` is that test, asked of the backend that serves the
tensors' device (``comm/backends.py``: in a ``"cpu:gloo,cuda:nccl"`` world NCCL
serves CUDA tensors, although the world's backend name says gloo too); the patch
layer also uses it to keep megatron's coalesced bucket collectives, which torch's
gloo cannot run on CUDA tensors, off that path (``megatron/grad_sync.py``,
``megatron/param_sync.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.backends import backend_of
from megatron_sdp4bit.comm.exact_alltoall import alltoall_reduce_scatter
from megatron_sdp4bit.comm.handles import finish_or_handle

# torch 2.13 renamed the tensor forms; older versions only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def runs_on_host_staged_gloo(group, device) -> bool:
    """Whether collectives over ``group`` on tensors of ``device`` go through gloo's
    host staging: a CUDA device that gloo serves in ``group``."""
    if torch.device(device).type != "cuda":
        return False
    return backend_of(group, device) == "gloo"


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """Concatenate every rank's equal-sized ``input`` into ``output``."""
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op, group, async_op: bool,
                        as_alltoall: bool = False):
    """The exact reduce-scatter (rank r gets shard r of the reduction); with
    ``as_alltoall`` (the config's ``exact_reduce_scatter="alltoall"``) an all-to-all
    plus a local sum on any backend, as it always is on gloo with CUDA tensors."""
    if as_alltoall or runs_on_host_staged_gloo(group, input.device):
        return alltoall_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    return _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op)


def all_reduce_flat(tensor: torch.Tensor, op, group, async_op: bool):
    """All-reduce in place. gloo has no AVG: there it is a SUM, divided once it is done."""
    if op != dist.ReduceOp.AVG or backend_of(group, tensor.device) != "gloo":
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    size = dist.get_world_size(group)

    def finish() -> None:
        work.wait()
        tensor.div_(size)

    return finish_or_handle(finish, async_op)


def all_to_all_equal(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = True):
    """All-to-all of equal chunks: chunk j of ``input`` goes to group rank j."""
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)
