"""scripts/count_chunk_work.py: what one reduce-scatter chunk asks of the host, counted.

The host issues every chunk's work while the backward pass runs (comm/runner.py), so
what a chunk costs it is a property of the code that a change can make worse without
any result changing. Counted here (no GPU: the Triton launches recorded, a fake
process group), per chunk of a two-level TLq-HS reduce-scatter: exactly three kernel
launches and two collective calls, the two seed draws and nothing else that would
launch a kernel, no read of a device value on the host; and the chunk plan of
configs/gpt_6.7b.yaml at DP 16 stays at a few hundred chunks a step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("recording needs the compiled kernels (not the interpreter)", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("chunks") / "work.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "count_chunk_work.py"),
                             "--repeats", "3", "--chunks", "6", "--json", str(out)],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_chunk_is_three_launches_two_collectives_and_no_host_read(counted, dtype):
    work = counted[0]["per_chunk"][dtype]
    assert work["chunks"] == 6
    assert work["triton_launches"] == 3  # quantize, dequantize-sum-requantize, dequantize-sum
    assert work["collective_calls"] == 2  # the intra- and the inter-node all-to-all
    assert work["host_reads"] == 0  # the host never waits for the device
    assert work["device_ops"] == 2, work["ops"]  # the two seed draws, nothing else
    assert work["host_us"] > 0


def test_the_6_7b_model_at_dp_16_makes_a_few_hundred_chunks_a_step(counted):
    data, stdout = counted
    assert data["chunks_per_step"] <= 300 < data["chunks_per_step_4m"]
    assert "chunks a step" in stdout and "command: python scripts/count_chunk_work.py" in stdout
