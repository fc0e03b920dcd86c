"""What one pipeline chunk of a quantized reduce-scatter asks of the host.

With --overlap-grad-reduce the host issues every chunk's stages (on a worker
thread or a side stream, ``comm/runner.py``) while the backward pass goes on, so
the host time per chunk, times the chunks per step, is work the host must find
time for. Counted here without a GPU and without peers:

- a ``fake`` process group of ``dp`` ranks (torch's testing backend: every
  collective returns at once, nothing is sent);
- the Triton ops in recording mode (``quant.triton_kernels.launch_record``): each
  launch is bound and keyed as on a GPU, and recorded instead of run;
- a ``TorchDispatchMode`` that counts what else reaches torch's dispatcher:
  collective calls (the ``c10d`` ops), host reads of device values
  (``_local_scalar_dense``: ``.item()``, ``float(t)``, ``bool(t)``) and other
  operators, which launch a kernel each on a GPU (views excepted).

``measure`` returns per chunk: Triton launches, collective calls, other device
ops, host reads, and the host time (median over ``repeats`` calls), for one
bucket: use small chunks (``pipeline_chunks``); the host work per chunk does not
depend on its size. ``chunks_per_step`` is the chunk plan of a model's buckets.
Run ``scripts/count_chunk_work.py``; its figures are in docs/performance.md.
"""
from __future__ import annotations

import collections
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_sdp4bit.comm.layout import MAX_CHUNK_ELEMENTS, MIN_CHUNK_SHARD_ELEMENTS, chunk_count
from megatron_sdp4bit.config import SDP4BitConfig

VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "as_strided", "alias", "t", "reshape",
            "unsqueeze", "squeeze", "expand", "narrow", "detach", "empty", "empty_strided"}
"""Operators that launch no kernel on a GPU (views, and allocations from the cache)."""


@dataclass(frozen=True)
class ChunkWork:
    """Per chunk of one bucket's quantized reduce-scatter."""

    chunks: int
    triton_launches: float
    collective_calls: float
    device_ops: float
    """Other operators that launch a kernel on a GPU (seed draws, copies, ...)."""
    host_reads: float
    host_us: float
    """Host time per chunk (median of the calls), in microseconds of this thread's CPU
    time (so other load on the machine counts less): the call's, less the launches'
    recording (a GPU adds each Triton launch's own cost instead). The collective calls
    are in it, their Python and C++ alike; keep the chunks small, so that the fake
    backend's work on the buffers is not."""
    host_us_min: float
    """The least disturbed call's (other load only ever adds time)."""
    ops: dict
    """Every operator counted, per chunk (views included), for a reader who wants to see."""

    def as_dict(self) -> dict:
        return asdict(self)


class _Count(TorchDispatchMode):
    """Counts the operators that reach torch's dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[f"{func.namespace}.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def init_fake_world(dp: int, rank: int = 0) -> None:
    """A process group of ``dp`` ranks in which nothing is sent (this process only)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp)


def measure(bucket_numel: int, config: SDP4BitConfig, dtype=torch.float32,
            repeats: int = 5) -> ChunkWork:
    """Count one bucket's reduce-scatter on this process's (fake) world, as ``ChunkWork``.
    Needs Triton's compiled kernels (not ``TRITON_INTERPRET``)."""
    from megatron_sdp4bit import comm
    from megatron_sdp4bit.comm.layout import chunk_plan
    from megatron_sdp4bit.comm.workspace import Workspace
    from megatron_sdp4bit.quant.triton_kernels.launch_record import recording

    dp = dist.get_world_size()
    rank = dist.get_rank()
    grads = torch.randn(bucket_numel, dtype=dtype)
    shard = bucket_numel // dp
    out = grads[rank * shard:(rank + 1) * shard]
    workspace = Workspace()
    generator = torch.Generator().manual_seed(0)
    topology = comm.get_topology(None, config.ranks_per_node)
    align = config.grad_alignment([level.name for level in topology.levels])
    chunks = len(chunk_plan(shard, align, chunk_count(shard, dp, config.pipeline_chunks,
                                                      MAX_CHUNK_ELEMENTS)))

    def call():
        comm.quantized_reduce_scatter(out, grads, config=config, generator=generator,
                                      workspace=workspace)

    with recording() as launches:
        call()  # the workspace's buffers are allocated here, as in a first step
        del launches[:]
        counter = _Count()
        with counter:
            call()
        triton = len(launches)
        times = []
        for _ in range(repeats):  # the host's own time, less the recording
            del launches[:]
            started = time.thread_time()
            call()
            elapsed = time.thread_time() - started
            times.append(elapsed - sum(x.record_s for x in launches))
    ops = counter.ops
    collectives = sum(n for name, n in ops.items() if name.startswith("c10d."))
    reads = ops.get("aten._local_scalar_dense", 0)
    device = sum(n for name, n in ops.items()
                 if name.startswith("aten.") and name.split(".", 1)[1] not in VIEW_OPS
                 and name != "aten._local_scalar_dense")
    return ChunkWork(chunks=chunks, triton_launches=triton / chunks,
                     collective_calls=collectives / chunks, device_ops=device / chunks,
                     host_reads=reads / chunks, host_us=1e6 * statistics.median(times) / chunks,
                     host_us_min=1e6 * min(times) / chunks,
                     ops={name: n / chunks for name, n in sorted(ops.items())})


def chunks_per_step(bucket_numels, dp: int, config: SDP4BitConfig,
                    max_chunk_elements: int = MAX_CHUNK_ELEMENTS) -> int:
    """Reduce-scatter chunks of one step over buckets of these sizes (``comm.layout``)."""
    return sum(chunk_count(numel // dp, dp, config.pipeline_chunks, max_chunk_elements,
                           MIN_CHUNK_SHARD_ELEMENTS) for numel in bucket_numels)


def model_buckets(config_path: str, dp: int) -> list:
    """The DDP buckets (elements) of a driver config's first pipeline stage at data-parallel
    size ``dp``, megatron's default bucket size (the estimator's layout arithmetic)."""
    from megatron_sdp4bit.estimate.gpt_shape import (bucket_numels, default_bucket_size,
                                                 load_model_shape, stage_params)

    shape = load_model_shape(config_path)
    params = stage_params(shape, shape.tensor_parallel, shape.pipeline_parallel, 0)
    return bucket_numels(params, dp, default_bucket_size(dp))
