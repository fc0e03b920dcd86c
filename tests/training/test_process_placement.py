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
    check_runner_flag,
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


@pytest.mark.parametrize("runner, device, backend, why", [
    ("thread", "cuda", "nccl", "a worker thread runs gloo's collectives, and this job's run on nccl"),
    ("stream", "cpu", "gloo", "its side stream is a CUDA stream, and this job's gradients are on cpu"),
])
def test_a_runner_that_cannot_serve_the_backend_is_refused_naming_the_flag(runner, device, backend, why):
    """Before the model is built, with or without megatron's overlap flags (it would only
    be refused where DDP is built otherwise, or silently unused without them)."""
    from megatron_sdp4bit.config import preset

    with pytest.raises(ArgumentError) as error:
        check_runner_flag(preset("sdp4bit", runner=runner), device, backend)
    assert str(error.value) == (f"--sdp4bit-runner {runner} cannot run here: {why}; leave it at "
                                "auto (the runner for this backend)")
    for fine in (("auto", "cpu", "gloo"), ("auto", "cuda", "nccl"), ("inline", "cuda", "nccl"),
                 ("thread", "cuda", "gloo"), ("stream", "cuda", "gloo"), ("stream", "cuda", "nccl"),
                 ("deferred", "cpu", "gloo"), ("deferred", "cuda", "nccl")):
        check_runner_flag(preset("sdp4bit", runner=fine[0]), *fine[1:])
    check_runner_flag(None, "cpu", "gloo")  # no --sdp4bit: nothing to check


def test_the_flag_takes_megatron_lms_choices():
    assert parse_args(["--distributed-backend", "gloo"]).distributed_backend == "gloo"
    assert parse_args([]).distributed_backend is None
    with pytest.raises(ArgumentError, match="--distributed-backend"):
        parse_args(["--distributed-backend", "mpi"])


@pytest.mark.parametrize("env, line", [
    ({"LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE='abc' in the environment is not an integer >= 1: torchrun sets "
     "these variables for each rank; unset them to run one process"),
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0' in the environment is not an integer >= 1"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' in the environment is not an integer >= 0"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 of WORLD_SIZE=2 (LOCAL_RANK=0 of LOCAL_WORLD_SIZE=2) in the "
     "environment: a rank must be below its size"),
])
def test_a_launcher_variable_that_cannot_be_is_named(monkeypatch, env, line):
    """Issue 28, round two: before, ``invalid literal for int() with base 10: 'abc'`` (or,
    for LOCAL_WORLD_SIZE=0 with --sdp4bit, a line from the layer about ``ranks_per_node``
    after the process group was up)."""
    from megatron_sdp4bit.training.distributed import LauncherEnvironmentError, init_distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LauncherEnvironmentError) as refused:
        init_distributed()
    assert str(refused.value).startswith(line)


def test_a_world_that_never_forms_is_said_and_ends_in_one_line(tmp_path):
    """RANK=0 WORLD_SIZE=2 left in a shell, one process started: it says whom it waits for,
    and at the timeout (10 minutes in the driver; 3 s here) one line, not the store's
    traceback after a silent wait."""
    import os
    import re
    import subprocess
    import sys

    from megatron_sdp4bit.jobs import free_port

    code = ("from megatron_sdp4bit.training.distributed import LauncherEnvironmentError, init_distributed\n"
            "try:\n    init_distributed(timeout_minutes=0.05)\n"
            "except LauncherEnvironmentError as error:\n    print('refused:', error)\n")
    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONWARNINGS": "ignore"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    waiting, refused = done.stdout.splitlines()
    assert waiting == (f"waiting up to 0.05 min for the 1 other rank(s) of WORLD_SIZE=2 at 127.0.0.1:{port} (RANK "
                       "and WORLD_SIZE are set in the environment; unset them to run one process)")
    assert re.fullmatch(rf"refused: the 2 ranks of WORLD_SIZE=2 did not all join at 127\.0\.0\.1:{port} within 0\.05 "
                        r"min \(Timed out after \d+ seconds waiting for clients\. 1/2 clients joined\.\): start every "
                        r"rank \(torchrun does, setting RANK and WORLD_SIZE for each\), or unset RANK and WORLD_SIZE to "
                        r"run one process", refused), done.stdout + done.stderr[-2000:]
