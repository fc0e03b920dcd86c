#!/usr/bin/env python
"""The pre-training driver with the exact reduce-scatter done as an all-to-all (ring bytes).

gloo's ``reduce_scatter_tensor`` is a ring all-reduce (twice the bytes of the
ring reduce-scatter NCCL runs). For a like-for-like exact baseline on gloo,
this runs ``megatron_sdp4bit.pretrain`` with megatron-core's reduce-scatter
function (and the patch layer's exact one) replaced by
``megatron_sdp4bit.comm.exact_alltoall.alltoall_reduce_scatter``, which sends
each rank ``(P - 1)`` shards, as a ring reduce-scatter does. Everything else
(flags, output) is the driver's. Used by ``scripts/bench_slow_link.py``'s
``baseline-a2a`` preset:

    torchrun ... scripts/pretrain_exact_alltoall.py <driver flags> --sdp4bit-preset baseline

Synchronous reduce-scatters only: under ``--overlap-grad-reduce`` megatron waits
on its coalescing manager, which would not run the local sum.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sdp4bit.comm import exact_alltoall, primitives  # noqa: E402


def main() -> int:
    if "--overlap-grad-reduce" in sys.argv[1:]:
        print("pretrain_exact_alltoall: --overlap-grad-reduce is not supported (megatron would "
              "wait on its coalescing manager, not on the all-to-all's local sum)", file=sys.stderr)
        return 2
    from megatron.core.distributed import param_and_grad_buffer

    param_and_grad_buffer.dist_reduce_scatter_func = exact_alltoall.alltoall_reduce_scatter
    primitives._reduce_scatter_flat = exact_alltoall.alltoall_reduce_scatter
    from megatron_sdp4bit import pretrain

    return pretrain.main()


if __name__ == "__main__":
    sys.exit(main())
