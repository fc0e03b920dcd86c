"""Does this torch's gloo run the collectives megatron's bucket groups issue?

    torchrun --nproc-per-node 4 -m megatron_sdp4bit.diagnostics.gloo_collectives

megatron-core on CPU (``megatron_sdp4bit.cpu_backend``) patches no collective: with
torch 2.13, gloo implements everything ``_ParamAndGradBucketGroup`` calls. A torch
that lacks one would hang or train wrongly, so ``check_gloo_collectives(group)`` runs
exactly those calls -- for fp32 and bf16, coalesced async ``reduce_scatter_tensor``
(SUM and AVG) and coalesced async ``all_gather_into_tensor`` -- and compares them with
the exact answer, raising ``RuntimeError`` that names the missing or wrong one. The
tests' harness runs it on every world it starts. Run as a module: exit status 0 and
one line from rank 0 when all hold; 1 and one line from each rank where one failed.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def check_gloo_collectives(group: "dist.ProcessGroup | None" = None) -> None:
    """Verify on ``group`` (default: the world) the gloo collectives megatron relies on."""
    group = group if group is not None else dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / group.size())):
            _check_reduce_scatter(group, dtype, op, scale)
        _check_all_gather(group, dtype)


def _coalesced(group, calls, what: str) -> None:
    """Run ``calls`` (async collectives) in megatron's coalescing manager and wait."""
    from torch.distributed import _coalescing_manager

    try:
        with _coalescing_manager(group, async_ops=True) as manager:
            for call in calls:
                call()
        manager.wait()
    except (RuntimeError, NotImplementedError, ValueError) as err:
        raise RuntimeError(f"CPU backend: this torch's gloo cannot run megatron's coalesced async "
                           f"{what}: {err}") from err


def _check_reduce_scatter(group, dtype, op, scale: float) -> None:
    rank, size = group.rank(), group.size()
    inputs = [torch.arange(2 * size, dtype=dtype) * (k + 1) + rank for k in range(2)]
    outputs = [torch.empty(2, dtype=dtype) for _ in range(2)]
    _coalesced(group, [lambda out=out, inp=inp: dist.reduce_scatter_tensor(
        out, inp, op=op, group=group, async_op=True) for out, inp in zip(outputs, inputs)],
        f"reduce_scatter_tensor ({op}, {dtype})")
    ranks_sum = size * (size - 1) / 2
    for k, out in enumerate(outputs):
        index = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float64)
        want = (index * (k + 1) * size + ranks_sum) * scale
        if not torch.allclose(out.double(), want, rtol=1e-2):
            raise RuntimeError(f"CPU backend: gloo reduce_scatter_tensor ({op}, {dtype}) returned "
                               f"{out.tolist()} on rank {rank}, expected {want.tolist()}")


def _check_all_gather(group, dtype) -> None:
    rank, size = group.rank(), group.size()
    shards = [torch.full((2,), float(rank + k), dtype=dtype) for k in range(2)]
    gathered = [torch.empty(2 * size, dtype=dtype) for _ in range(2)]
    _coalesced(group, [lambda out=out, inp=inp: dist.all_gather_into_tensor(
        out, inp, group=group, async_op=True) for out, inp in zip(gathered, shards)],
        f"all_gather_into_tensor ({dtype})")
    for k, out in enumerate(gathered):
        want = (torch.arange(size).repeat_interleave(2) + k).to(dtype)
        if not torch.equal(out, want):
            raise RuntimeError(f"CPU backend: gloo all_gather_into_tensor ({dtype}) returned "
                               f"{out.tolist()} on rank {rank}, expected {want.tolist()}")


def main() -> int:
    dist.init_process_group("gloo")
    try:
        check_gloo_collectives()
        failure = None
    except RuntimeError as error:
        failure = str(error)
    failed = torch.tensor([failure is not None], dtype=torch.int64)
    dist.all_reduce(failed)
    if failure is not None:
        print(f"rank {dist.get_rank()}: {failure}", file=sys.stderr)
    elif dist.get_rank() == 0 and not int(failed):
        print(f"the gloo collectives megatron's bucket groups use: correct on {dist.get_world_size()} ranks")
    dist.destroy_process_group()
    return 1 if int(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
