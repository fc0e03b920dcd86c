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


def test_the_overlap_study_shows_the_link_wait_each_preset_leaves_exposed(tmp_path):
    """L (no limit), S_R and O_R of a preset with and without overlap: the link wait is
    S_R - L, of which O_R - L stays exposed; the estimator's prediction stands beside it."""
    run = lambda step: RunResult([step], 5.0e6, 2.0e6, 1.0e7, 3.0, 0.4,  # noqa: E731
                                 waited_rs_per_step=0.05, waited_ag_per_step=0.15)
    cells = {(rate, preset): Cell([run(step)]) for (rate, preset), step in {
        (None, "baseline-a2a"): 1.5, (100.0, "baseline-a2a"): 5.0,
        (None, "sdp4bit"): 1.0, (100.0, "sdp4bit"): 2.0,
        (None, "sdp4bit-overlap"): 1.1, (100.0, "sdp4bit-overlap"): 1.3}.items()}
    probed = Probed(10.0, {None: 9.0, 100.0: 0.0958}, 7.0, {None: 8.0, 100.0: 2000.0})
    path = tmp_path / "overlap.json"
    write_json(str(path), COMMAND.replace("baseline-a2a,sdp4bit",
                                          "baseline-a2a,sdp4bit,sdp4bit-overlap"),
               probed, cells, None)
    proc = _replay(path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if "exposed O_R - L" in line):]
    row = next(line for line in table if line.startswith("| 100 Mbit/s | SDP4Bit"))
    fields = [f.strip() for f in row.split("|")[1:-1]]
    # L 1.0, S_R 2.0, O_R 1.3: wait 1.0 s, 0.3 s of it exposed (30%), 0.2 s against L_O
    assert fields[2:8] == ["1.000", "2.000", "1.300", "1.000", "0.300", "30%"]
    assert fields[8] == "30% [30, 30]"  # one round: its own share
    assert fields[9] == "0.200" and fields[10] == "1.54x"
    assert len(fields) == 14  # and the two predicted columns
    assert fields[11] == "0.050 + 0.150"  # what rank 0's training thread waited on, per direction
    assert float(fields[13]) < float(fields[12])  # the estimator hides part of the wait too


def test_each_round_pairs_its_own_runs_and_a_calibration_run_is_left_out():
    """A round's share uses that round's L, S_R and O_R: a machine that slows down between
    rounds moves all three, and the pooled medians' share, not the round's."""
    from megatron_sdp4bit.benchmarks.slow_link.report import round_shares

    cell = lambda *steps: Cell([RunResult([s, s], 0.0, 0.0, 0.0, 1.0) for s in steps])  # noqa: E731
    # round 1 on a calm machine, round 2 on one 50% slower: 20% exposed in both
    loop = cell(9.0, 1.0, 1.5)  # the first run is a calibration run (--calibrate)
    plain, both = cell(2.0, 3.0), cell(1.2, 1.8)
    assert [round(s, 6) for s in round_shares(loop, plain, both)] == [0.2, 0.2]
    # a round whose limited run was no slower than the unlimited one has no share
    assert round_shares(cell(2.0), cell(1.9), cell(2.1)) == []


def test_estimating_needs_a_first_preset_without_overlap():
    proc = subprocess.run([sys.executable, SCRIPT, "--estimate", "--rates", "loopback,100",
                           "--presets", "sdp4bit-overlap,sdp4bit"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and "put sdp4bit (or another preset) first" in proc.stderr


def test_a_run_without_link_probes_replays_its_tables_without_the_estimator(tmp_path):
    run = lambda step: RunResult([step], 5.0e6, 2.0e6, 1.0e7, 3.0, None)  # noqa: E731
    cells = {(None, "sdp4bit"): Cell([run(1.0)]), (50.0, "sdp4bit"): Cell([run(2.0)]),
             (None, "sdp4bit-overlap"): Cell([run(1.0)]), (50.0, "sdp4bit-overlap"): Cell([run(1.5)])}
    path = tmp_path / "noprobe.json"
    write_json(str(path), "sudo .venv/bin/python scripts/bench_slow_link.py --probe off",
               Probed(0.0, {}), cells, None)
    proc = _replay(path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "did not probe their links" in proc.stdout and "exposed O_R - L" in proc.stdout


def test_num_layers_reaches_the_ranks_and_the_replayed_estimate(tmp_path):
    """``--num-layers``: the ranks train that model, and a replay prices that model's bytes
    (read back from the file's command), not the default one's."""
    from argparse import Namespace

    from megatron_sdp4bit.benchmarks.slow_link.presets import NUM_LAYERS
    from megatron_sdp4bit.benchmarks.slow_link.runs import node_command

    argv = node_command(Namespace(num_layers=12, dtype="fp32", iters=6, python=sys.executable),
                        0, 29600, "sdp4bit-overlap", str(tmp_path / "run"))
    assert argv[argv.index("--num-layers") + 1] == "12" and argv.count("--num-layers") == 1
    default = node_command(Namespace(num_layers=NUM_LAYERS, dtype="fp32", iters=6,
                                     python=sys.executable), 0, 29600, "sdp4bit", str(tmp_path))
    assert default[default.index("--num-layers") + 1] == str(NUM_LAYERS)

    probed = Probed(10.0, {None: 9.0, 100.0: 0.0958}, 7.0, {None: 8.0, 100.0: 200.0})
    waits = {}
    # the file's own model, whatever the replay's command line says
    for layers, flag in ((NUM_LAYERS, ""), (12, " --num-layers=12")):
        path = tmp_path / f"layers{layers}.json"
        write_json(str(path), COMMAND + flag, probed, _cells(), None)
        proc = subprocess.run([sys.executable, SCRIPT, "--replay", str(path), "--num-layers", "7"],
                              capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = {line.split("|")[2].strip(): float(line.split("|")[5])
                for line in proc.stdout.splitlines() if line.startswith("| 100 Mbit/s (0.0958)")}
        # the exact collectives' link time grows with the model more than SDP4Bit's
        waits[layers] = next(v for k, v in rows.items() if k.startswith("exact")) - next(
            v for k, v in rows.items() if k.startswith("SDP4Bit"))
    assert waits[12] > 1.5 * waits[NUM_LAYERS]
