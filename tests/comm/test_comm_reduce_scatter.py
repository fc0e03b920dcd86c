"""Quantized reduce-scatter vs torch's exact reduce_scatter_tensor, on real gloo ranks.

Inputs and the cases themselves live in comm_cases_grads.py / comm_cases_stats.py;
the error bound and its derivation in megatron_sdp4bit/comm/error_bounds.py.
"""
from __future__ import annotations

import itertools

import pytest

from comm_battery import ranks_per_node_choices
from comm_cases_grads import DTYPES, MODES, OPS, SCHEDULES
from comm_results import cases
from megatron_sdp4bit.config import SDP4BitConfig

pytestmark = pytest.mark.slow  # real gloo processes


def test_every_combination_ran(results, world):
    """mode x dtype x op x (sync/async, chunks 1/4) for every ranks-per-node choice."""
    for rpn in ranks_per_node_choices(world):
        ran = {tuple(key.split("|")[2:7]) for _, key, _ in cases(results, f"rs|rpn={rpn}|")}
        for mode, dtype, op, (async_op, chunks) in itertools.product(MODES, DTYPES, OPS,
                                                                      SCHEDULES):
            assert (mode, dtype, op, f"async={async_op}", f"chunks={chunks}") in ran


def test_passthrough_is_bit_exact(results):
    checked = 0
    for rank, key, value in cases(results, "rs|"):
        if "|off|" in key:
            assert value["bitwise"], f"rank {rank} {key}: differs from reduce_scatter_tensor"
            assert value["matches_fp32"], f"rank {rank} {key}: differs from the fp32 integer sum"
            checked += 1
    assert checked > 0


def test_quantized_error_within_scale_bound(results):
    """|out - exact| <= bound from the scales (megatron_sdp4bit/comm/error_bounds.py), every element, every case."""
    worst = {}
    for rank, key, value in cases(results, "rs|"):
        if "ratio" in value:
            assert value["ratio"] <= 1.0, f"rank {rank} {key}: error {value['max_err']:.4g} " \
                                          f"exceeds the bound ({value['ratio']:.3f}x)"
            mode = key.split("|")[2]
            worst[mode] = max(worst.get(mode, 0.0), value["max_err"])
    # The comparison is not vacuous: every quantized mode did lose some precision.
    assert set(worst) >= {"tlq-hs", "tlq", "ulq"} and min(worst.values()) > 0


def test_chunking_async_interleaving_and_aliasing_change_nothing(results):
    """With nearest rounding the pipeline schedule must not change a single bit, nor
    must splitting a bucket into as many chunks as the chunk-size cap asks; with
    stochastic rounding an async call equals a sync one (the same draws in order)."""
    for rank, key, value in cases(results, "sched|"):
        assert value == {"capped_chunks": True, "stochastic_async_is_sync": True,
                         "chunked_async": True, "interleaved": True, "aliased": True,
                         "completed_before_wait": False, "completed_after_wait": True}, \
            f"rank {rank} {key}: {value}"


def test_stochastic_rounding_is_unbiased_over_seeds(stats_results):
    """Averaging over 40 seeds shrinks the error ~1/sqrt(40) (0.16); nearest stays at 1."""
    assert cases(stats_results, "unbiased|")
    for rank, key, value in cases(stats_results, "unbiased|"):
        if key.endswith("|stochastic"):
            assert value["ratio"] < 0.3, f"rank {rank} {key}: mean error did not average out"
            assert abs(value["z"]) < 5, f"rank {rank} {key}: signed error z={value['z']:.2f}"
        else:  # the control proves the statistic can fail
            assert value["ratio"] > 0.9, f"rank {rank} {key}: {value}"


def test_streams_are_reproducible_and_seeded(stats_results):
    assert cases(stats_results, "repro|")
    for rank, key, value in cases(stats_results, "repro|"):
        assert value == {"same_seed": True, "other_seed_differs": True}, f"rank {rank}: {value}"


def test_hadamard_lowers_error_on_outliers(stats_results):
    """Gradients with 100x outliers: TLq-HS's RMS error well below TLq's at the same bits."""
    outliers = [value for _, _, value in cases(stats_results, "hadamard|rpn=2|outliers")]
    assert outliers
    hs = sum(v["tlq-hs"] for v in outliers) / len(outliers)
    plain = sum(v["tlq"] for v in outliers) / len(outliers)
    assert hs < 0.6 * plain, f"TLq-HS rms {hs:.3f} vs TLq {plain:.3f}"


def _expected_rs_wire(world: int, rpn: int, mode: str, shard: int = 1024) -> dict:
    """Analytic bytes per level for one fp32 reduce-scatter of shards of ``shard`` elements."""
    nodes, per_node = world // rpn, rpn
    exact = {"intra": (per_node - 1) * shard * 4, "inter": (world - per_node) * shard * 4}
    if mode == "off":
        return {lv: {"values": exact[lv], "exact": exact[lv]} for lv in exact}
    config = SDP4BitConfig(grad_mode=mode)
    hops = {"intra": (config.effective_grad_bits_intra, config.grad_group_size_intra),
            "inter": (config.grad_bits_inter, config.grad_group_size_inter)}
    if nodes > 1 and per_node > 1:
        elements = {"intra": (per_node - 1) * nodes * shard, "inter": (nodes - 1) * shard}
    elif nodes == 1:
        elements = {"intra": (world - 1) * shard, "inter": 0}
    else:
        elements = {"intra": 0, "inter": (world - 1) * shard}
    return {lv: {"codes": elements[lv] * hops[lv][0] // 8,
                 "scales": elements[lv] // hops[lv][1] * 4,
                 "elements": elements[lv], "exact": exact[lv]} for lv in exact}


def test_wire_bytes_match_analytic_volume(results, world):
    """8 + 32/G bits intra and 4 + 32/G inter (ULq: 4 + 32/G both), exact = fp32 shards."""
    for rpn in ranks_per_node_choices(world):
        for mode in MODES:
            expected = _expected_rs_wire(world, rpn, mode)
            for rank, per_rank in enumerate(results):
                stats = per_rank[f"wire|rs|rpn={rpn}|{mode}"]
                assert stats["calls"]["reduce_scatter"] == 1
                for level, want in expected.items():
                    got = stats["reduce_scatter"][level]
                    for field, value in want.items():
                        assert got[field] == value, \
                            f"rank {rank} rpn={rpn} {mode} {level} {field}: {got[field]} != {value}"
                    if mode != "off" and got["elements"]:
                        bits = 8 * (got["codes"] + got["scales"]) / got["elements"]
                        high = 8 if level == "intra" and mode != "ulq" else 4
                        assert bits == pytest.approx(high + 32 / 128)
