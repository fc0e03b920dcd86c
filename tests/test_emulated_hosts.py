"""``python -m megatron_sdp4bit.emulated_hosts``: several hosts on one machine.

Properties: each emulated host is one torchrun node of one job whose ranks see their
own ``SDP4BIT_HOST_ID`` and one host's ``LOCAL_WORLD_SIZE``; the driver launched this
way learns 2 nodes from the hosts (no ``--sdp4bit-ranks-per-node``) and says so, with
each data-parallel group's hops (dense and expert); a node that fails stops the others
and its status is the command's, instead of a hang; no entry is refused in one line.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from megatron_sdp4bit import emulated_hosts
from megatron_sdp4bit.jobs import job_env

REPORT_RANK = """
import json, os, sys
out = sys.argv[1]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in ("SDP4BIT_HOST_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK")}, f)
"""

FAIL_ON_RANK_0 = """
import os, sys, time
if os.environ["RANK"] == "0":
    sys.exit(3)
time.sleep(600)  # a peer that would wait for rank 0 forever
"""


def test_each_node_is_one_host_of_one_job():
    nodes = emulated_hosts.node_commands(2, 3, ["-m", "x"], port=12345, python="py")
    assert [host for host, _ in nodes] == ["emulated-host-0", "emulated-host-1"]
    for node, (_, argv) in enumerate(nodes):
        assert argv[:3] == ["py", "-m", "torch.distributed.run"]
        joined = " ".join(argv)
        assert f"--nnodes 2 --node-rank {node} --master-addr 127.0.0.1 --master-port 12345" in joined
        assert "--nproc-per-node=3" in argv and argv[-2:] == ["-m", "x"]


def test_the_ranks_see_their_host_and_one_hosts_local_world(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT_RANK)
    assert emulated_hosts.run(2, 2, [str(script), str(tmp_path)]) == 0
    seen = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)}
    assert {rank: s["SDP4BIT_HOST_ID"] for rank, s in seen.items()} == {
        0: "emulated-host-0", 1: "emulated-host-0", 2: "emulated-host-1", 3: "emulated-host-1"}
    assert {s["LOCAL_WORLD_SIZE"] for s in seen.values()} == {"2"}
    assert {s["WORLD_SIZE"] for s in seen.values()} == {"4"}


def test_a_failing_node_stops_the_others_and_gives_its_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_0)
    started = time.monotonic()
    status = emulated_hosts.run(2, 1, [str(script)])
    assert status != 0
    assert time.monotonic() - started < 120  # not the peer's 600 s sleep


def test_no_entry_is_refused_in_one_line():
    result = subprocess.run([sys.executable, "-m", "megatron_sdp4bit.emulated_hosts", "--hosts", "2"],
                            capture_output=True, text=True, env=job_env(), timeout=60)
    assert result.returncode == 2
    assert "nothing to run" in result.stderr.strip().splitlines()[-1]


def test_the_driver_learns_two_nodes_from_the_hosts_with_experts(tmp_path):
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "2", "--log-interval", "1",
             "--eval-interval", "1000", "--eval-iters", "1", "--default-corpus-mb", "1",
             "--no-progress-bar", "--sdp4bit", "--sdp4bit-check-interval", "1",
             "--overlap-grad-reduce", "--overlap-param-gather", "--bucket-size", "20000",
             "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
             "--run-dir", str(tmp_path / "run")]
    result = subprocess.run([sys.executable, "-m", "megatron_sdp4bit.emulated_hosts", "--hosts", "2",
                             "--ranks-per-host", "2", "--", "-m", "megatron_sdp4bit.pretrain", *flags],
                            capture_output=True, text=True, env=job_env(), timeout=540)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "sdp4bit nodes: 2 hosts x 2 ranks (from the hosts)\n" in output
    assert "sdp4bit overlapped collectives: thread runner: on a worker thread\n" in output  # gloo's
    assert ("sdp4bit gradient hops, DP 4: 8-bit inside a node (2 ranks), "
            "then 4-bit across nodes (2 ranks)") in output
    assert "sdp4bit gradient hops, expert DP 2: 4-bit across nodes (2 ranks)" in output
    assert ("sdp4bit weight gather, DP 4: 4-bit across nodes (2 ranks), "
            "then inside a node (2 ranks)") in output
    assert "sdp4bit weight gather, expert DP 2: 4-bit, one all-gather over 2 ranks" in output
    assert "replica checks      4 passed" in output  # the dense and the expert optimizer, 2 steps


def test_a_node_killed_by_a_signal_exits_as_a_shell_would_say():
    assert emulated_hosts._exit_status(-9) == 137 and emulated_hosts._exit_status(1) == 1
