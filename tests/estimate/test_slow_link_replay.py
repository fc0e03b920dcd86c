"""scripts/bench_slow_link.py --replay: saved runs, with and without the latency probe, are
predicted again by the current estimator (no root, nothing run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from megatron_sdp4bit.benchmarks.slow_link.estimates import Probed
from megatron_sdp4bit.benchmarks.slow_link.report import write_json
from megatron_sdp4bit.benchmarks.slow_link.runs import Cell, RunResult

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench_slow_link.py")
COMMAND = ("sudo .venv/bin/python scripts/bench_slow_link.py --dtype fp32 --estimate --calibrate "
           "--rates 100 --presets baseline-a2a,sdp4bit")


def _cells():
    run = lambda step: RunResult([step, step * 1.1], 5.0e6, 2.0e6, 1.0e7, 3.0, 0.4)  # noqa: E731
    return {(None, "baseline-a2a"): Cell([run(1.5)]),
            (100.0, "baseline-a2a"): Cell([run(5.0)]),
            (100.0, "sdp4bit"): Cell([run(2.0)])}


def _replay(path):
    return subprocess.run([sys.executable, SCRIPT, "--replay", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def test_replay_uses_the_probed_latency_and_reads_older_files(tmp_path):
    probed = Probed(10.0, {None: 9.0, 100.0: 0.0958}, 7.0, {None: 8.0, 100.0: 2000.0})
    new = tmp_path / "new.json"
    write_json(str(new), COMMAND, probed, _cells(), None)
    data = json.loads(new.read_text())
    assert data["latency_us"] == {"no limit (veth)": 8.0, "100 Mbit/s": 2000.0}
    old = tmp_path / "old.json"  # written before the latency probe existed
    old.write_text(json.dumps({k: v for k, v in data.items()
                               if k not in ("latency_us", "loopback_latency_us")}))
    predicted = {}
    for name, path in (("new", new), ("old", old)):
        proc = _replay(path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        row = next(line for line in proc.stdout.splitlines()
                   if line.startswith("| 100 Mbit/s (0.0958)") and "SDP4Bit" in line)
        predicted[name] = float(row.split("|")[5])  # the median step's prediction
    # 2 ms per message across nodes: SDP4Bit's messages take longer than with none
    assert predicted["new"] > predicted["old"]
    cluster = probed.cluster(100.0)
    assert (cluster.latency.intra_us, cluster.latency.inter_us) == (7.0, 2000.0)
    assert cluster.inter_gbps == 0.0958 and cluster.intra_gbps == 10.0
