"""Quantized reduce-scatter vs torch's exact reduce_scatter_tensor, on real gloo ranks.

Each ``@battery.case`` below runs inside every rank of the shared worlds
(``comm_worlds``) and returns plain numbers; the tests after it assert on them. The
error bound and its derivation are in megatron_sdp4bit/comm/error_bounds.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from comm_worlds import (
    STATISTICS_WORLDS,
    WORLDS,
    battery,
    compare_with_bound,
    exact_reduce_scatter,
    make_input,
    ranks_per_node_choices,
    run_reduce_scatter,
)
from megatron_sdp4bit.comm import (
    get_wire_stats,
    quantized_reduce_scatter,
    reset_generators,
    reset_wire_stats,
)
from megatron_sdp4bit.config import SDP4BitConfig

pytestmark = pytest.mark.slow  # real gloo processes

MODES = ("off", "tlq-hs", "tlq", "ulq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
SHARD_SIZES = (1, 37, 300, 1024)  # odd sizes exercise the padding
SCHEDULES = ((False, 1), (False, 4), (True, 1), (True, 4))  # (async_op, pipeline chunks)
SEEDS = 40  # independent rounding streams of the unbiasedness check


# --- every mode x dtype x op x schedule --------------------------------------------------

@battery.case(*WORLDS)
def matrix(rank: int, world: int) -> list:
    """One record per (ranks per node, mode, dtype, op, schedule), rotating the shard sizes."""
    records = []
    for rpn in ranks_per_node_choices(world):
        num_nodes = max(1, world // rpn)
        combos = itertools.product(MODES, DTYPES.items(), OPS.items(), SCHEDULES)
        for index, (mode, (dname, dtype), (oname, op), (async_op, chunks)) in enumerate(combos):
            shard = SHARD_SIZES[index % len(SHARD_SIZES)]
            config = SDP4BitConfig(grad_mode=mode, ranks_per_node=rpn, pipeline_chunks=chunks)
            x = make_input(rank, index, world * shard, dtype, integers=(mode == "off"))
            out = run_reduce_scatter(x, config, op, async_op=async_op)
            record = dict(rpn=rpn, mode=mode, dtype=dname, op=oname, async_op=async_op,
                          chunks=chunks, shard=shard)
            if mode == "off":
                exact32 = exact_reduce_scatter(x.float(), op)
                record.update(bitwise=torch.equal(out, exact_reduce_scatter(x, op)),
                              matches_fp32=torch.equal(out.float(), exact32))
            else:
                record.update(compare_with_bound(x, out, config, op, None, num_nodes))
            records.append(record)
    return records


@battery.case(*WORLDS)
def unequal_group_sizes(rank: int, world: int) -> dict:
    """Intra and inter group sizes that differ: the chunks must align to both."""
    out = {}
    for rpn in ranks_per_node_choices(world):
        config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, grad_group_size_intra=256,
                               grad_group_size_inter=64, pipeline_chunks=3)
        x = make_input(rank, 99, world * 700, torch.float32, integers=False)
        result = run_reduce_scatter(x, config, dist.ReduceOp.SUM)
        out[rpn] = compare_with_bound(x, result, config, dist.ReduceOp.SUM, None,
                                      max(1, world // rpn))
    return out


def test_every_combination_ran(world):
    """mode x dtype x op x (sync/async, chunks 1/4) for every ranks-per-node choice."""
    for records in battery.results(matrix, world):
        ran = {(r["rpn"], r["mode"], r["dtype"], r["op"], r["async_op"], r["chunks"])
               for r in records}
        for rpn in ranks_per_node_choices(world):
            for mode, dtype, op, (async_op, chunks) in itertools.product(MODES, DTYPES, OPS,
                                                                          SCHEDULES):
                assert (rpn, mode, dtype, op, async_op, chunks) in ran


def test_passthrough_is_bit_exact(world):
    checked = 0
    for rank, records in enumerate(battery.results(matrix, world)):
        for r in records:
            if r["mode"] == "off":
                assert r["bitwise"], f"rank {rank} {r}: differs from reduce_scatter_tensor"
                assert r["matches_fp32"], f"rank {rank} {r}: differs from the fp32 integer sum"
                checked += 1
    assert checked > 0


def test_quantized_error_within_scale_bound(world):
    """|out - exact| <= bound from the scales (megatron_sdp4bit/comm/error_bounds.py), every
    element, every case."""
    worst = {}
    unequal = battery.results(unequal_group_sizes, world)
    for rank, records in enumerate(battery.results(matrix, world)):
        cases = [(r["mode"], r) for r in records if r["mode"] != "off"]
        cases += [("tlq-hs-g256-64", {"rpn": rpn, **v}) for rpn, v in unequal[rank].items()]
        for mode, r in cases:
            assert r["ratio"] <= 1.0, f"rank {rank} {mode} {r}: error {r['max_err']:.4g} " \
                                      f"exceeds the bound ({r['ratio']:.3f}x)"
            worst[mode] = max(worst.get(mode, 0.0), r["max_err"])
    # The comparison is not vacuous: every quantized mode did lose some precision.
    assert set(worst) >= {"tlq-hs", "tlq", "ulq"} and min(worst.values()) > 0


# --- schedules: chunking, async, interleaving, aliasing ------------------------------------

def _capped_chunks(rank: int, world: int, config, x) -> dict:
    """A bucket larger than a chunk may hold: many chunks launched one after another, sync
    or async, the output aliasing the input. Both take
    the same steps in the same order, so with stochastic rounding they draw the same
    random numbers: bit-identical too."""
    from megatron_sdp4bit.comm import reduce_scatter_plan

    avg, shard = dist.ReduceOp.AVG, x.numel() // world
    caps = reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS
    reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS = world * 256, 1
    try:
        capped_sync = x.clone()
        capped_view = capped_sync[rank * shard:(rank + 1) * shard]
        quantized_reduce_scatter(capped_view, capped_sync, op=avg, config=config)
        capped_async = run_reduce_scatter(x, config, avg, async_op=True)
        rounded = [run_reduce_scatter(x, config.replace(rounding="stochastic"), avg,
                                      async_op=async_op,
                                      generator=torch.Generator().manual_seed(5 + rank))
                   for async_op in (False, True)]
    finally:
        reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS = caps
    return {"sync": capped_view, "async": capped_async, "rounded": rounded}


@battery.case(*WORLDS)
def schedules(rank: int, world: int) -> dict:
    """With nearest rounding, chunking, async, aliasing and interleaving change nothing."""
    out = {}
    avg = dist.ReduceOp.AVG
    for rpn in ranks_per_node_choices(world):
        config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=rpn, rounding="nearest")
        x = make_input(rank, 11, world * 3000, torch.bfloat16, integers=False)
        y = make_input(rank, 12, world * 2000, torch.float32, integers=False)
        base_x = run_reduce_scatter(x, config, avg)
        base_y = run_reduce_scatter(y, config, avg)
        cfg4 = config.replace(pipeline_chunks=4)
        chunked = run_reduce_scatter(x, cfg4, avg, async_op=True)
        # Two async calls, waited in launch order. Without a runner (comm/runner.py) an
        # async call runs at call time; test_comm_runner.py checks the overlapped kind.
        out_x, out_y = torch.empty_like(base_x), torch.empty_like(base_y)
        hx = quantized_reduce_scatter(out_x, x, op=avg, config=cfg4, async_op=True)
        hy = quantized_reduce_scatter(out_y, y, op=avg, config=cfg4, async_op=True)
        done_early = hx.is_completed()
        hx.wait()
        hy.wait()
        hy.wait()  # a second wait is a no-op
        # Megatron style: the output is a view of the input's own shard.
        buffer = x.clone()
        shard = buffer.numel() // world
        aliased = buffer[rank * shard:(rank + 1) * shard]
        quantized_reduce_scatter(aliased, buffer, op=avg, config=cfg4)
        capped = _capped_chunks(rank, world, config, x)
        out[rpn] = {
            "capped_chunks": torch.equal(capped["sync"], base_x) and torch.equal(capped["async"],
                                                                                base_x),
            "stochastic_async_is_sync": torch.equal(*capped["rounded"]),
            "chunked_async": torch.equal(chunked, base_x),
            "interleaved": torch.equal(out_x, base_x) and torch.equal(out_y, base_y),
            "aliased": torch.equal(aliased, base_x),
            "completed_before_wait": done_early,
            "completed_after_wait": hx.is_completed(),
        }
    return out


def test_chunking_async_interleaving_and_aliasing_change_nothing(world):
    """With nearest rounding the pipeline schedule must not change a single bit, nor
    must splitting a bucket into as many chunks as the chunk-size cap asks; with
    stochastic rounding an async call equals a sync one (the same draws in order)."""
    for rank, per_rpn in enumerate(battery.results(schedules, world)):
        for rpn, value in per_rpn.items():
            assert value == {"capped_chunks": True, "stochastic_async_is_sync": True,
                             "chunked_async": True, "interleaved": True, "aliased": True,
                             "completed_before_wait": True, "completed_after_wait": True}, \
                f"rank {rank} rpn={rpn}: {value}"


# --- statistics (2 ranks per node) ---------------------------------------------------------

@battery.case(*STATISTICS_WORLDS)
def unbiased(rank: int, world: int) -> dict:
    """Average the output over SEEDS independent rounding streams.

    Unbiased rounding: the per-element mean error shrinks like 1/sqrt(SEEDS)
    (ratio ~0.16 here), and the signed total is a ~N(0,1) z-score. Nearest
    rounding is the control: the same error every time, ratio 1.
    """
    x = make_input(rank, 21, world * 512, torch.float32, integers=False)
    reference = exact_reduce_scatter(x, dist.ReduceOp.SUM).double()
    out = {}
    for mode, rounding in (("tlq-hs", "stochastic"), ("tlq", "stochastic"),
                           ("ulq", "stochastic"), ("tlq", "nearest")):
        config = SDP4BitConfig(grad_mode=mode, ranks_per_node=2, rounding=rounding)
        errors = []
        for seed in range(SEEDS):
            gen = torch.Generator().manual_seed(100_003 * seed + rank)
            result = run_reduce_scatter(x, config, dist.ReduceOp.SUM, generator=gen)
            errors.append(result.double() - reference)
        errors = torch.stack(errors)  # [seeds, shard]
        single = errors.abs().mean()
        z = float(errors.sum() / errors.pow(2).sum().sqrt())
        out[(mode, rounding)] = {
            "ratio": float(errors.mean(0).abs().mean() / single) if single > 0 else 0.0, "z": z}
    return out


def test_stochastic_rounding_is_unbiased_over_seeds(stats_world):
    """Averaging over 40 seeds shrinks the error ~1/sqrt(40) (0.16); nearest stays at 1."""
    for rank, per_mode in enumerate(battery.results(unbiased, stats_world)):
        for (mode, rounding), value in per_mode.items():
            if rounding == "stochastic":
                assert value["ratio"] < 0.3, f"rank {rank} {mode}: mean error did not average out"
                assert abs(value["z"]) < 5, f"rank {rank} {mode}: signed error z={value['z']:.2f}"
            else:  # the control proves the statistic can fail
                assert value["ratio"] > 0.9, f"rank {rank} {mode} {rounding}: {value}"


@battery.case(*STATISTICS_WORLDS)
def reproducible(rank: int, world: int) -> dict:
    """Same seed -> same output after ``reset_generators``; another seed -> different output."""
    x = make_input(rank, 31, world * 640, torch.float32, integers=False)
    config = SDP4BitConfig(grad_mode="tlq-hs", ranks_per_node=2, seed=5)
    runs = []
    for cfg in (config, config, config.replace(seed=6)):
        reset_generators()
        runs.append(run_reduce_scatter(x, cfg, dist.ReduceOp.SUM))
    return {"same_seed": torch.equal(runs[0], runs[1]),
            "other_seed_differs": not torch.equal(runs[0], runs[2])}


def test_streams_are_reproducible_and_seeded(stats_world):
    for rank, value in enumerate(battery.results(reproducible, stats_world)):
        assert value == {"same_seed": True, "other_seed_differs": True}, f"rank {rank}: {value}"


@battery.case(*STATISTICS_WORLDS)
def hadamard_on_outliers(rank: int, world: int) -> dict:
    """RMS error of TLq-HS vs TLq (same bits) on gradients with 100x outliers, and without."""
    out = {}
    for label, outliers in (("outliers", 100.0), ("gaussian", 0.0)):
        x = make_input(rank, 41, world * 4096, torch.float32, integers=False, outliers=outliers)
        reference = exact_reduce_scatter(x, dist.ReduceOp.SUM).double()
        rms = {}
        for mode in ("tlq-hs", "tlq"):
            config = SDP4BitConfig(grad_mode=mode, ranks_per_node=2)
            total = 0.0
            for seed in range(3):
                gen = torch.Generator().manual_seed(7 * seed + rank)
                result = run_reduce_scatter(x, config, dist.ReduceOp.SUM, generator=gen)
                total += float((result.double() - reference).pow(2).mean())
            rms[mode] = (total / 3) ** 0.5
        out[label] = rms
    return out


def test_hadamard_lowers_error_on_outliers(stats_world):
    """Gradients with 100x outliers: TLq-HS's RMS error well below TLq's at the same bits."""
    outliers = [value["outliers"] for value in battery.results(hadamard_on_outliers, stats_world)]
    hs = sum(v["tlq-hs"] for v in outliers) / len(outliers)
    plain = sum(v["tlq"] for v in outliers) / len(outliers)
    assert hs < 0.6 * plain, f"TLq-HS rms {hs:.3f} vs TLq {plain:.3f}"


# --- bytes on the wire ---------------------------------------------------------------------

@battery.case(*WORLDS)
def wire_bytes(rank: int, world: int) -> dict:
    """Byte counters of one fp32 reduce-scatter per mode (shard a multiple of every group)."""
    out = {}
    for rpn in ranks_per_node_choices(world):
        for mode in MODES:
            config = SDP4BitConfig(grad_mode=mode, ranks_per_node=rpn)
            x = make_input(rank, 7, world * 1024, torch.float32, integers=False)
            reset_wire_stats()
            run_reduce_scatter(x, config, dist.ReduceOp.SUM)
            out[(rpn, mode)] = get_wire_stats().as_dict()
    return out


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


def test_wire_bytes_match_analytic_volume(world):
    """8 + 32/G bits intra and 4 + 32/G inter (ULq: 4 + 32/G both), exact = fp32 shards."""
    per_rank = battery.results(wire_bytes, world)
    for rpn in ranks_per_node_choices(world):
        for mode in MODES:
            expected = _expected_rs_wire(world, rpn, mode)
            for rank, recorded in enumerate(per_rank):
                stats = recorded[(rpn, mode)]
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
