"""--check-paper (Table 2 within 20% with one constant set per cluster), the derived constants,
the break-even search, and --kernel-rates from a real scripts/bench_quant.py --json file."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_sdp4bit.estimate import cli, paper
from megatron_sdp4bit.estimate.clusters import A100_SLINGSHOT, CLUSTER_TYPES, H800_IB
from megatron_sdp4bit.estimate.implementation import PAPER_REFERENCE, THIS_PROJECT
from megatron_sdp4bit.estimate.kernels import OPS, KernelModel, MeasuredRates

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _main(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_paper_passes_and_prints_every_row(capsys):
    code, out, err = _main(["--check-paper"], capsys)
    assert code == 0 and err == ""
    rows = [line for line in out.splitlines() if line.startswith("| a100") or line.startswith("| h800")]
    assert len(rows) == 10 and "10 of 10 rows within 20%" in out
    assert sum("(calibration)" in row for row in rows) == 2  # the two H800 calibration rows
    for row in paper.check_paper(CLUSTER_TYPES):
        assert row.within, row
        assert row.published == paper.TABLE2[(row.cluster, row.model)]


def test_check_paper_exits_non_zero_when_a_constant_is_off(capsys):
    """Ten times the inter-node rate makes the exact collectives far too fast."""
    code, out, _ = _main(["--check-paper", "--inter-gbps", "5000"], capsys)
    assert code == 1
    assert "off: " in out and "a100-slingshot 6.7B" in out
    broken = {n: dataclasses.replace(t, tflops=t.tflops * 3) for n, t in CLUSTER_TYPES.items()}
    assert not all(r.within for r in paper.check_paper(broken))


def test_check_paper_takes_no_run_flags(capsys):
    code, out, err = _main(["--check-paper", "--nodes", "4"], capsys)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("sdp4bit-estimate: error: --nodes")


def test_the_a100_network_is_what_table_4_measured():
    """clusters.py states the rates paper.table4_rates derives from the paper's Table 4."""
    stream, inter = paper.table4_rates(A100_SLINGSHOT)
    assert stream == pytest.approx(A100_SLINGSHOT.stream_gbps, rel=0.01)
    assert inter == pytest.approx(A100_SLINGSHOT.inter_gbps, rel=0.01)
    assert inter <= A100_SLINGSHOT.line_gbps  # within 2 NICs x 100 Gbit/s
    exact, sdp = paper._table4_seconds(A100_SLINGSHOT)
    assert exact == pytest.approx(paper.TABLE4_EXACT_S, rel=0.01)
    assert sdp == pytest.approx(paper.TABLE4_SDP4BIT_S, rel=0.01)


def test_the_h800_constants_are_its_calibration():
    tflops, inter = paper.calibrate(H800_IB)
    assert tflops == pytest.approx(H800_IB.tflops, rel=0.01)
    assert inter == pytest.approx(H800_IB.inter_gbps, rel=0.01)


def test_break_even_is_where_the_speedup_crosses_1_1():
    gbps = paper.break_even_gbps(A100_SLINGSHOT, "13B", PAPER_REFERENCE)
    assert A100_SLINGSHOT.inter_gbps < gbps < math.inf
    factor = gbps / A100_SLINGSHOT.inter_gbps
    at = dataclasses.replace(A100_SLINGSHOT, inter_gbps=gbps,
                             stream_gbps=A100_SLINGSHOT.stream_gbps * factor)
    assert paper.paper_estimate(at, "13B").speedup("sdp4bit") == pytest.approx(1.1, abs=0.005)
    slower = paper.break_even_gbps(A100_SLINGSHOT, "13B", THIS_PROJECT)
    assert slower < gbps  # more calls and messages per step: it stops paying sooner


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bench") / "bench_quant.json")
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_quant.py"), "--sizes",
                    "1,2", "--repeats", "1", "--json", path], check=True, capture_output=True,
                   timeout=600)
    return path


def test_kernel_rates_are_the_bench_files_own(bench_json):
    data = json.load(open(bench_json))
    rates = MeasuredRates.from_bench_json(bench_json)
    assert rates.sizes_mib == (1.0, 2.0)
    model = KernelModel("measured", measured=rates)
    for result in data["results"]:
        numel = result["numel"]
        for op_row in result["ops"]:
            for op, (_, key, _) in OPS.items():
                if key == op_row["key"]:
                    assert model.seconds(op, numel) == pytest.approx(op_row["seconds"], rel=1e-9)
        assert model.seconds("grad_stage_rows", numel) == pytest.approx(
            result["clone"]["seconds"], rel=1e-9)


def test_kernel_rates_tolerate_new_rows_and_name_what_is_missing(bench_json, tmp_path, capsys):
    data = json.load(open(bench_json))
    data["new_key"] = 1
    for result in data["results"]:  # bench_quant.py may add ops: they are ignored
        result["ops"].append(dict(result["ops"][0], key="a_new_op", name="a new op"))
    extended = tmp_path / "extended.json"
    extended.write_text(json.dumps(data))
    base = ["--config", os.path.join(REPO, "configs", "gpt_1.3b.yaml"), "--nodes", "2",
            "--cluster-type", "h800-ib"]
    code, out, _ = _main([*base, "--kernel-rates", str(extended)], capsys)
    assert code == 0 and f"measured: {extended}" in out
    for result in data["results"]:
        result["ops"] = [op for op in result["ops"] if op["key"] != "hadamard_quantize_8bit"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    for path, words in ((broken, "hadamard_quantize_8bit"), (tmp_path / "none.json", "cannot read")):
        code, out, err = _main([*base, "--kernel-rates", str(path)], capsys)
        (line,) = err.strip().splitlines()
        assert code == 2 and out == "" and "--kernel-rates" in line and words in line, line
