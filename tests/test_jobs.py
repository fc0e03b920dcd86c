"""megatron_sdp4bit.jobs: the command lines every launcher of the package writes."""
from __future__ import annotations

import socket
import sys

import pytest

from megatron_sdp4bit import jobs
from megatron_sdp4bit.benchmarks.emulated_nodes import node_torchrun


def test_one_node_jobs_rendezvous_standalone():
    assert jobs.torchrun_command(4, ["-m", "x", 3]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "x", "3"]
    assert jobs.driver_command(["--lr", 1e-3], 2, python="py") == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "megatron_sdp4bit.pretrain", "--lr", "0.001"]
    with pytest.raises(ValueError, match="nproc_per_node must be >= 1"):
        jobs.torchrun_command(0)


def test_a_node_of_an_emulated_pair_runs_in_its_namespace_on_its_veth():
    argv = node_torchrun(1, 29601, 2, ["-m", "megatron_sdp4bit.pretrain"], "py")
    assert argv[:4] == ["ip", "netns", "exec", "sdp4bit-n1"]
    assert argv[4:9] == ["env", "GLOO_SOCKET_IFNAME=sdp4bit-v1", "SDP4BIT_HOST_ID=sdp4bit-n1",
                         "OMP_NUM_THREADS=1", "PYTHONWARNINGS=ignore"]
    assert argv[9:] == ["py", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
                        "--master-addr", "10.77.0.1", "--master-port", "29601",
                        "--nproc-per-node=2", "-m", "megatron_sdp4bit.pretrain"]


def test_job_env_keeps_what_is_set_and_defaults_the_rest(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    env = jobs.job_env(EXTRA="1")
    assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONWARNINGS"] == "error"
    assert env["EXTRA"] == "1"


def test_free_port_can_be_bound():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", jobs.free_port()))


def test_run_driver_logs_the_command_and_the_output(tmp_path, monkeypatch):
    calls = []

    def fake_call(command, stdout, stderr, env, cwd, timeout):
        calls.append((command, cwd, timeout))
        stdout.write("driver output\n")
        return 3

    monkeypatch.setattr(jobs.subprocess, "call", fake_call)
    job = jobs.run_driver(["--x"], str(tmp_path / "logs" / "a.log"), ranks=2, timeout=5,
                          cwd=str(tmp_path))
    command, cwd, timeout = calls[0]
    assert command[-3:] == ["megatron_sdp4bit.pretrain", "--no-progress-bar", "--x"]
    assert (cwd, timeout, job.returncode) == (str(tmp_path), 5, 3)
    assert job.output().splitlines() == ["$ " + " ".join(command[1:]), "driver output"]
    assert job.tail(1) == "driver output"


def test_checkout_commit_outside_git_is_unknown(tmp_path):
    assert jobs.checkout_commit(str(tmp_path)) == "unknown"
