"""The quantization errors the driver logs are those of the hops that ran.

On one node (2 ranks, 2 a node) only the 8-bit intra-node hop runs; the driver's
``grad_quant_rel_error`` is then that hop's (it read the inter-node hop's only, which
issue 28 item 11 stopped reporting where it never ran, and the log said null).
"""
from __future__ import annotations

import os

from driver_runs import TINY_GPT, captured_run, driver_world, train_records


def _one_node(rank, world_size, root):
    captured_run(TINY_GPT + ["--train-iters", "2", "--sdp4bit", "--sdp4bit-ranks-per-node", "2",
                             "--run-dir", os.path.join(root, "one-node")])
    return rank


def test_a_one_node_run_logs_its_intra_node_gradient_error(tmp_path_factory):
    root, _ = driver_world(tmp_path_factory, "errors", _one_node, 2, timeout_s=600)
    records = train_records(root, "one-node")
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["grad_quant_rel_error"] is not None and r["grad_quant_rel_error"] > 0
               for r in records), records
