"""The process group of the self-check and the collectives benchmark (diagnostics/world.py):
which backend ``--backend`` gives on which machine, and the one-line refusals of nccl where
it cannot run. Pure functions and in-process CLI calls that stop before any process group
(this machine has no GPU: the NCCL path itself is not run here)."""
from __future__ import annotations

import pytest

from megatron_sdp4bit.benchmarks import collectives
from megatron_sdp4bit.diagnostics import device_collectives
from megatron_sdp4bit.diagnostics.world import Machine, WorldError, choose_backend


def machine(gpus: int, ranks: int, cuda: bool = True) -> Machine:
    return Machine(cuda_available=cuda and gpus > 0, gpu_count=gpus, local_rank=0,
                   local_world_size=ranks)


@pytest.mark.parametrize("gpus, ranks, device, want", [
    (8, 8, "cuda", "nccl"),   # a cluster node: one rank per GPU
    (8, 4, "cuda", "nccl"),
    (1, 4, "cuda", "gloo"),   # one GPU shared by 4 ranks (gpu_check's dp4): NCCL refuses that
    (8, 1, "cuda", "gloo"),   # one rank: nothing to talk to
    (0, 4, "cpu", "gloo"),    # no CUDA
    (8, 8, "cpu", "gloo"),    # CPU tensors are gloo's
])
def test_auto_picks_nccl_only_where_every_rank_has_a_gpu(gpus, ranks, device, want):
    assert choose_backend("auto", machine(gpus, ranks), device) == want


def test_gloo_is_always_served():
    assert choose_backend("gloo", machine(0, 4), "cpu") == "gloo"
    assert choose_backend("gloo", machine(1, 4), "cuda") == "gloo"


@pytest.mark.parametrize("gpus, ranks, device, words", [
    (0, 2, "cuda", "needs CUDA, and torch sees none here"),
    (2, 4, "cuda", "this node runs 4 ranks on 2 visible GPU(s); set --nproc-per-node to at most 2"),
    (8, 8, "cpu", "checks CUDA tensors: drop --device cpu"),
])
def test_nccl_refuses_in_one_line_what_it_cannot_run(gpus, ranks, device, words):
    with pytest.raises(WorldError, match="use --backend gloo") as error:
        choose_backend("nccl", machine(gpus, ranks), device)
    assert words in str(error.value) and "\n" not in str(error.value)
    assert choose_backend("nccl", machine(2, 2), "cuda") == "nccl"


@pytest.mark.parametrize("main, argv", [
    (device_collectives.main, ["--backend", "nccl"]),
    (collectives.main, ["--backend", "nccl", "--cases", "variants", "--numel", "8"]),
])
def test_nccl_without_cuda_is_one_line_and_exit_2(main, argv, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "error: --backend nccl needs CUDA" in captured.err


def test_the_levels_the_self_check_runs():
    assert device_collectives.level_counts("both", 4, 2) == [4, 2]
    assert device_collectives.level_counts("both", 2, 2) == [2]  # one node of 2: one level
    assert device_collectives.level_counts("1", 8, 2) == [8]
    with pytest.raises(ValueError, match="--levels 2 needs --ranks-per-node below the 2 ranks"):
        device_collectives.level_counts("2", 2, 2)
