"""scripts/bench_quant.py: the bytes each op moves, the fractions of clone bandwidth,
and the --json that scripts/gpu_check.sh keeps (a GPU run must not be the first
time these are computed)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_sdp4bit import quant

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_quant.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_quant", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def test_nbytes_counts_packed_codes_padded_to_groups_and_one_scale_per_group():
    q = quant.quantize(torch.randn(100), 4, 64, "nearest")  # 2 groups, padded to 128 elements
    assert bench.nbytes(q) == 128 // 2 + 2 * 4
    q = quant.quantize(torch.randn(100), 2, 64, "nearest")
    assert bench.nbytes(q) == 128 // 4 + 2 * 4
    q = quant.quantize(torch.randn(256), 8, 128, "nearest")
    assert bench.nbytes(q) == 256 + 2 * 4
    assert bench.nbytes(torch.zeros(10, dtype=torch.bfloat16), torch.zeros(3)) == 20 + 12
    with pytest.raises(TypeError):
        bench.nbytes(3)


def test_every_op_reads_and_writes_what_its_tensors_hold():
    n = 2 * bench.WEIGHT_GROUP * bench.MANY_CHUNKS  # what bench_size makes: whole groups x chunks
    x = torch.randn(n)
    k, many = bench.RANKS_PER_NODE, bench.MANY_CHUNKS
    w_codes, w_scales = n // 2, 4 * n // bench.WEIGHT_GROUP  # 4-bit, G=2048
    g_scales = 4 * n // bench.GRAD_GROUP  # G=128
    expected = {
        "clone": (4 * n, 4 * n),
        "quantize_4bit_stochastic": (4 * n, w_codes + w_scales),
        "quantize_4bit_nearest": (4 * n, w_codes + w_scales),
        "dequantize_4bit_fp32": (w_codes + w_scales, 4 * n),
        "quantize_weight_diff_4bit": (4 * n + 2 * n, w_codes + w_scales),  # fp32 main, bf16 model
        "dequantize_add_4bit_bf16": (w_codes + w_scales + 2 * n, 2 * n),  # bf16 base in place
        "hadamard_quantize_8bit": (4 * n, n + g_scales),
        # k chunks of 8-bit codes in, one 4-bit chunk (n / k elements) out
        "dequantize_sum_requantize_8to4": (n + g_scales, n // k // 2 + g_scales // k),
        "dequantize_sum_4bit_hadamard": (n // 2 + g_scales, 4 * n // k),
        "quantize_4bit_stochastic_bf16": (2 * n, w_codes + w_scales),  # bf16 input
        "hadamard_quantize_8bit_bf16": (2 * n, n + g_scales),
        # fp32 rows and the send order (8 int64 indices)
        "hadamard_quantize_rows_8bit": (4 * n + 8 * bench.ROWS, n + g_scales),
        "dequantize_sum_requantize_8to4_8chunks": (n + g_scales, n // many // 2 + g_scales // many),
        "dequantize_sum_4bit_hadamard_8chunks": (n // 2 + g_scales, 4 * n // many),
    }
    ops = bench.make_ops(x, seed=0)
    assert [op.key for op in ops] == list(expected)
    assert len({op.name for op in ops}) == len(ops)
    for op in ops:
        assert bench.traffic(op, op.fn()) == expected[op.key], op.key


def _fake_ops(keys):
    return [bench.Op(key, key, lambda: None, ()) for key in keys]


def test_fractions_are_of_clone_bandwidth_and_judged_against_the_target():
    numel = 1000
    moved = {"clone": (4000, 4000), "fast": (4000, 500), "slow": (4000, 500)}
    seconds = {"clone": 1.0, "fast": 4500 / 8000 / 0.9, "slow": 4500 / 8000 / 0.8}
    result = bench.summarize(2.0, numel, _fake_ops(moved), seconds, moved, target=0.85)
    assert result["clone"]["bytes_per_s"] == pytest.approx(8000)
    rows = {row["key"]: row for row in result["ops"]}
    assert set(rows) == {"fast", "slow"}  # clone is the reference, not an op to judge
    assert rows["fast"]["fraction_of_clone"] == pytest.approx(0.9)
    assert rows["slow"]["fraction_of_clone"] == pytest.approx(0.8)
    assert rows["fast"]["meets_target"] and not rows["slow"]["meets_target"]
    assert rows["fast"]["bytes_per_s"] == pytest.approx(0.9 * 8000)
    # the earlier normalisation: bytes of the fp32 input over time, clone time over op time
    assert rows["fast"]["input_bytes_per_s"] == pytest.approx(4000 / seconds["fast"])
    assert rows["fast"]["clone_time_ratio"] == pytest.approx(1.0 / seconds["fast"])
    table = bench.format_table(result, judge=True)
    assert "| fast |" in table and "| PASS |" in table and "| FAIL |" in table
    assert "PASS" not in bench.format_table(result, judge=False)


def test_cpu_smoke_run_prints_the_table_and_writes_the_json(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--sizes", "0.03,0.07", "--repeats", "1",
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 * (1 + 14)  # header + clone + 13 ops, per size
    report = json.loads(out.read_text())
    assert report["device_type"] == "cpu" and report["target_applies"] is False
    assert report["target_fraction"] == bench.TARGET
    assert [r["numel"] for r in report["results"]] == [16384, 16384]  # rounded to whole quanta
    for size in report["results"]:
        assert size["clone"]["bytes_read"] == size["clone"]["bytes_written"] == 4 * size["numel"]
        assert len(size["ops"]) == 13
        assert {"quantize_4bit_stochastic_bf16", "dequantize_sum_requantize_8to4_8chunks",
                "hadamard_quantize_rows_8bit"} <= {row["key"] for row in size["ops"]}
        for row in size["ops"]:
            assert row["bytes_read"] > 0 and row["bytes_written"] > 0 and row["seconds"] > 0
            moved = (row["bytes_read"] + row["bytes_written"]) / row["seconds"]
            assert row["bytes_per_s"] == pytest.approx(moved)
            assert row["fraction_of_clone"] == pytest.approx(moved / size["clone"]["bytes_per_s"])
