"""diagnostics/overlap_profile.py: the share of the quantized work that runs beside the rest.

The arithmetic on time lines is checked here on hand-made traces (what the GPU
check's "overlap" step reports rests on it); the profile itself runs in
scripts/gpu_check.sh (``--cpu-smoke`` too, tests/scripts/test_gpu_check.py).
"""
from __future__ import annotations

import pytest

from megatron_sdp4bit.diagnostics.overlap_profile import (busy_fraction, covered, kernel_spans,
                                                          stream_table, thread_spans)


def test_covered_counts_the_time_some_other_interval_runs_beside_each_target():
    # target 0-10 overlaps 2-4 and 3-6 (union 2-6: 4) and 9-12 (1); target 20-30 none
    assert covered([(0, 10), (20, 30)], [(3, 6), (2, 4), (9, 12), (40, 50)]) == (20.0, 5.0)
    assert covered([(0, 10)], []) == (10.0, 0.0)
    assert covered([], [(0, 1)]) == (0.0, 0.0)
    # overlapping targets are counted once, and an other spanning several targets in full
    assert covered([(0, 4), (2, 6), (8, 10)], [(1, 9)]) == (8.0, 6.0)


@pytest.mark.parametrize("n", [2000])
def test_covered_is_one_pass_over_many_intervals(n):
    targets = [(3.0 * i, 3.0 * i + 1) for i in range(n)]
    others = [(3.0 * i + 0.5, 3.0 * i + 2) for i in range(n)]
    assert covered(targets, others) == (float(n), 0.5 * n)


def test_kernels_and_threads_are_told_apart_by_name_stream_and_thread():
    events = [
        {"ph": "X", "cat": "kernel", "name": "quantize_kernel", "ts": 0, "dur": 10,
         "args": {"stream": 3}},
        {"ph": "X", "cat": "kernel", "name": "dequantize_kernel", "ts": 20, "dur": 5,
         "args": {"stream": 3}},
        {"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "ts": 5, "dur": 20,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllToAll", "ts": 0, "dur": 30,
         "args": {"stream": 9}},  # the collectives' own: not "other work"
        {"ph": "X", "cat": "kernel", "name": "elementwise", "ts": 30, "dur": 5,
         "args": {"stream": 3}},  # on the side stream: not the passes' work
        # the layer's error sampling on the compute stream: quantization, never beside it
        {"ph": "X", "cat": "kernel", "name": "hadamard_quantize_kernel", "ts": 40, "dur": 2,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "elementwise", "ts": 45, "dur": 5,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": 1, "tid": 9},
        {"ph": "M", "name": "thread_name", "tid": 7},
    ]
    off, on, passes = kernel_spans(events)
    assert off == [(0.0, 10.0), (20.0, 25.0)] and on == [(40.0, 42.0)]
    assert passes == [(5.0, 25.0), (45.0, 50.0)]
    assert covered(off, passes) == (15.0, 10.0)
    assert busy_fraction(passes) == pytest.approx(25 / 45) and busy_fraction([]) is None
    table = stream_table(events)
    assert table["7"]["kernels"] == 3 and table["7"]["quantization_kernels"] == 1
    assert table["3"]["quantization_seconds"] == pytest.approx(15e-6)
    worker, main = thread_spans(events, worker_tid=9, main_tid=7)
    assert worker == [(1.0, 2.0)] and main == [(0.0, 3.0)]


def test_the_compute_stream_is_the_one_with_the_most_non_quantization_time():
    # a run whose quantization kernels all ran on the compute stream (nothing moved off
    # it) has nothing beside the passes: no share, rather than a share of 0 that hides why
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d, "args": {"stream": s}}
              for n, t, d, s in [("gemm", 0, 50, 7), ("quantize_kernel", 50, 5, 7),
                                 ("copy", 0, 3, 13)]]
    off, on, passes = kernel_spans(events)
    assert off == [] and on == [(50.0, 55.0)] and passes == [(0.0, 50.0)]
