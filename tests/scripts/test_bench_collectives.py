"""The one collective benchmark (megatron_sdp4bit.benchmarks.collectives) on 2 real ranks
under torchrun, both case sets, and scripts/bench_collectives.py's table of it."""
from __future__ import annotations

import subprocess

import pytest

from megatron_sdp4bit.benchmarks import collectives
from megatron_sdp4bit.jobs import job_env, torchrun_command

pytestmark = pytest.mark.slow  # a torchrun job

NUMEL = 2 * 4096


@pytest.fixture(scope="module", params=sorted(collectives.CASE_SETS))
def rows(request):
    command = torchrun_command(2, ["-m", collectives.__name__, "--cases", request.param,
                                   "--numel", NUMEL, "--repeats", "2", "--ranks-per-node", "1",
                                   "--dtype", "fp32"])
    job = subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    return request.param, collectives.read_rows(job.stdout)


def test_every_case_ran_in_order_and_was_timed(rows):
    name, got = rows
    assert [r["label"] for r in got] == [case.label for case in collectives.CASE_SETS[name]]
    assert all(r["seconds"] > 0 for r in got)
    assert {r["backend"] for r in got} == {"gloo"}  # the default: CPU ranks


def test_the_bytes_are_the_collectives_own(rows):
    """Two nodes of one rank: everything crosses nodes; exact = one fp32 (rs) or model-dtype
    (ag) shard to the peer; the quantized calls send less."""
    _, got = rows
    shard = NUMEL // 2
    for row in got:
        inter = row["bytes"]["inter"]
        if row["label"].startswith("exact reduce-scatter, all-to-all") or "gloo" in row["label"]:
            continue  # not through the layer: nothing recorded
        assert inter["exact"] == shard * 4, row
        if row["label"].startswith("exact"):
            assert inter["sent"] == inter["exact"], row
        else:
            assert 0 < inter["sent"] < inter["exact"] / 3, row


@pytest.mark.parametrize("rows", ["variants"], indirect=True)  # bench_collectives.py's cases
def test_the_table_shows_time_against_the_exact_collective_of_the_same_kind(rows):
    _, got = rows
    table = collectives.bytes_table(got, 2, 1, NUMEL, 2)
    lines = table.splitlines()
    assert lines[0].startswith("2 gloo ranks on one CPU host as 2 emulated nodes x 1")
    assert sum(" | 1.00x | " in line for line in lines) == 2  # the first of each kind
    assert len([line for line in lines if line.startswith("| ")]) == 1 + len(got)
