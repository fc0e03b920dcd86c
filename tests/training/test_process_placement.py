"""Where a rank runs: ``--distributed-backend`` and the GPU each local rank takes.

``place_process`` is the whole decision, pure arithmetic over what the machine has,
so every case of a GPU machine is checked here without one: NCCL takes a GPU per
rank; gloo on a GPU machine lets ranks share the GPUs round-robin (how one GPU runs
4 data-parallel ranks); gloo without GPUs is the CPU backend; impossible
combinations stop before anything starts, naming the flag.
"""
from __future__ import annotations

import pytest

from megatron_sdp4bit.training.arguments import ArgumentError, parse_args
from megatron_sdp4bit.training.distributed import (
    ParallelLayout,
    ProcessPlacement,
    check_backend_layout,
    place_process,
)


@pytest.mark.parametrize("gpus,local_world", [(1, 4), (2, 4), (3, 8), (8, 8)])
def test_gloo_ranks_share_the_gpus_round_robin(gpus, local_world):
    placed = [place_process("gloo", gpus, r, local_world) for r in range(local_world)]
    assert [p.gpu for p in placed] == [r % gpus for r in range(local_world)]
    assert {(p.backend, p.device) for p in placed} == {("gloo", "cuda")}
    # every GPU gets ranks, none more than one above another
    counts = [sum(p.gpu == g for p in placed) for g in range(min(gpus, local_world))]
    assert max(counts) - min(counts) <= 1


def test_default_is_nccl_with_gpus_and_gloo_on_cpu_without():
    assert place_process(None, 8, 3, 8) == ProcessPlacement("nccl", "cuda", 3)
    assert place_process(None, 0, 3, 4) == ProcessPlacement("gloo", "cpu", None)
    assert place_process("gloo", 0, 1, 4) == ProcessPlacement("gloo", "cpu", None)


def test_nccl_with_more_ranks_than_gpus_is_refused_naming_gloo():
    with pytest.raises(ArgumentError, match="--distributed-backend gloo"):
        place_process("nccl", 1, 0, 4)
    with pytest.raises(ArgumentError, match="4 ranks on this node but 1 GPU"):
        place_process(None, 1, 2, 4)  # the default on a GPU machine is nccl


def test_nccl_without_a_gpu_is_refused():
    with pytest.raises(ArgumentError, match="needs CUDA GPUs"):
        place_process("nccl", 0, 0, 1)


def test_gloo_on_gpus_refuses_tensor_and_pipeline_parallelism():
    dp_only = ParallelLayout(world=4, data=4)
    check_backend_layout("cuda", "gloo", dp_only)
    check_backend_layout("cuda", "nccl", ParallelLayout(world=4, tensor=2, data=2))
    check_backend_layout("cpu", "gloo", ParallelLayout(world=4, pipeline=2, data=2))
    for layout in (ParallelLayout(world=4, tensor=2, data=2),
                   ParallelLayout(world=4, pipeline=2, data=2)):
        with pytest.raises(ArgumentError, match="data parallelism only"):
            check_backend_layout("cuda", "gloo", layout)


def test_the_flag_takes_megatron_lms_choices():
    assert parse_args(["--distributed-backend", "gloo"]).distributed_backend == "gloo"
    assert parse_args([]).distributed_backend is None
    with pytest.raises(ArgumentError, match="--distributed-backend"):
        parse_args(["--distributed-backend", "mpi"])
