"""device_collectives' runner case: on CUDA it reads back the side stream's priority and
fails when the stream does not outrank the compute stream (a priority the device did not
take raises nothing; only this case would show it). The GPU run is gpu_check's dp4
collectives step; here the priorities come from stand-in streams. Also: which runner the
synchronous reference of a case runs on."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_sdp4bit.comm.runner import ThreadRunner
from megatron_sdp4bit.diagnostics import device_collectives


def test_there_is_no_runner_case_without_a_side_stream():
    worker = ThreadRunner(torch.device("cpu"))
    try:
        assert worker.stream is None
        assert device_collectives.runner_case(worker, torch.device("cpu")) is None
    finally:
        worker.close()


@pytest.mark.parametrize("side, holds", [(-1, True), (0, False)])
def test_the_runner_case_fails_unless_the_side_stream_outranks_the_compute_stream(
        monkeypatch, side, holds):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(priority=0))
    runner = SimpleNamespace(kind="stream", stream=SimpleNamespace(priority=side))
    case = device_collectives.runner_case(runner, torch.device("cuda", 0))
    case["passed"] = device_collectives.passed(case)
    assert case["passed"] is holds
    line = device_collectives._describe(case)
    assert line.startswith("[PASS]" if holds else "[FAIL]")
    assert "bound ratio" not in line and f"priority {side} (compute 0)" in line
    assert ("NOT side stream" in line) is not holds
    table = device_collectives.summary_table([case])
    assert table.splitlines()[1].endswith("PASS" if holds else "FAIL")


def test_a_runner_with_its_own_chunk_cap_takes_the_synchronous_reference_too():
    """The deferring runner cuts buckets into its own (larger) chunks, so the sync call
    that an async one is compared with bit for bit runs through it as well; with the
    other runners the sync call stays on the caller, in the collectives' own chunks."""
    from megatron_sdp4bit.comm.deferring_runner import DeferringRunner

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    deferred = DeferringRunner(cpu)
    for async_op in (False, True):
        assert device_collectives._on(cpu, cpu, async_op, deferred)["runner"] is deferred
    worker = SimpleNamespace(whole_bucket_elements=None, group_for=lambda group: group)
    assert "runner" not in device_collectives._on(cpu, cpu, False, worker)
    assert device_collectives._on(cpu, cpu, True, worker)["runner"] is worker
    # the CPU reference of a check on CUDA never goes to the runner
    assert "runner" not in device_collectives._on(cpu, cuda, True, deferred)


@pytest.mark.parametrize("argv", [["--runner", "stream"], ["--runner", "stream", "--device", "cpu"],
                                  ["--runner", "stream", "--device", "cuda"]])
def test_the_stream_runner_without_cuda_is_one_line_and_exit_2(argv, capsys, monkeypatch):
    """``--runner stream`` puts the async calls on a CUDA side stream on any backend (gloo on
    one GPU in gpu_check's dp4 step); without CUDA tensors it stops before any process group,
    saying what to change."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert device_collectives.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "error: --runner stream runs the async calls on a CUDA side stream" in captured.err
    assert "--device cuda" in captured.err
