"""Quantized weight all-gather (qWD, qW, exact) on real gloo ranks.

Each ``@battery.case`` below runs inside every rank of the shared worlds
(``comm_worlds``) and returns plain numbers; the tests after it assert on them.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm_worlds import STATISTICS_WORLDS, WORLDS, battery, ranks_per_node_choices
from megatron_sdp4bit.comm import get_wire_stats, quantized_all_gather_weights, reset_wire_stats
from megatron_sdp4bit.comm.error_bounds import weight_bound
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant import dequantize, quantize

pytestmark = pytest.mark.slow  # real gloo processes

INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def identical_on_all_ranks(buffer: torch.Tensor) -> bool:
    """Bit-for-bit comparison of ``buffer`` across ranks (via its integer view)."""
    bits = buffer.view(INT_VIEW[buffer.dtype]).to(torch.int64)
    gathered = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bits)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def full_main(main_shard: torch.Tensor) -> torch.Tensor:
    gathered = [torch.empty_like(main_shard) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, main_shard)
    return torch.cat(gathered)


def initial_weights(world: int, shard: int, dtype) -> torch.Tensor:
    """The same model buffer on every rank (seeded identically)."""
    return torch.randn(world * shard, generator=torch.Generator().manual_seed(3)).to(dtype)


# --- one gather ------------------------------------------------------------------------

@battery.case(*WORLDS)
def one_step(rank: int, world: int) -> dict:
    """One gather per (ranks per node, mode, bits, dtype, size, sync/async): identical
    buffers, bounded error."""
    out = {}
    for rpn in ranks_per_node_choices(world):
        for mode in ("diff", "direct", "off"):
            for bits, dtype, shard, async_op in ((4, torch.bfloat16, 3000, False),
                                                 (4, torch.float32, 4096, True),
                                                 (8, torch.bfloat16, 4096, True),
                                                 (4, torch.bfloat16, 5, False)):
                config = SDP4BitConfig(weight_mode=mode, weight_bits=bits, ranks_per_node=rpn)
                model = initial_weights(world, shard, dtype)
                own = model[rank * shard:(rank + 1) * shard]
                gen = torch.Generator().manual_seed(50 + rank)
                main = own.float() + 0.01 * torch.randn(shard, generator=gen)
                source = main - own.float() if mode == "diff" else main.clone()
                handle = quantized_all_gather_weights(model, main, config=config,
                                                      async_op=async_op)
                if async_op:
                    handle.wait()
                entry = {"identical": identical_on_all_ranks(model)}
                new_own = model[rank * shard:(rank + 1) * shard].double()
                if mode == "off":
                    entry["exact"] = torch.equal(model, full_main(main).to(dtype))
                else:
                    bound = weight_bound(main, source, bits, config.weight_group_size, dtype)
                    entry["ratio"] = float(((new_own - main.double()).abs() / bound).max())
                out[(rpn, mode, bits, str(dtype)[6:], shard, async_op)] = entry
    return out


def test_all_ranks_hold_bit_identical_weights(world):
    for rank, per_case in enumerate(battery.results(one_step, world)):
        for key, value in per_case.items():
            assert value["identical"], f"rank {rank} {key}: model buffers differ across ranks"
        assert per_case


def test_exact_mode_equals_all_gather(world):
    for rank, per_case in enumerate(battery.results(one_step, world)):
        for key, value in per_case.items():
            if key[1] == "off":
                assert value["exact"], f"rank {rank} {key}"


def test_one_step_error_within_scale_bound(world):
    """|model - main| <= absmax(group of what was quantized) / qmax + buffer rounding."""
    for rank, per_case in enumerate(battery.results(one_step, world)):
        for key, value in per_case.items():
            if "ratio" in value:
                assert value["ratio"] <= 1.0, f"rank {rank} {key}: {value['ratio']:.3f}x the bound"


# --- a gather in slices ----------------------------------------------------------------

@battery.case(*WORLDS)
def sliced(rank: int, world: int) -> dict:
    """A synchronous gather of a shard larger than a slice may be (here: a slice is one
    group of 2048, the shard 5000, so 3 slices, the last padded) changes nothing with
    nearest rounding: the same buffer as gathered whole (async), on every rank."""
    from megatron_sdp4bit.comm import weights

    shard = 5000
    out = {}
    for rpn in ranks_per_node_choices(world):
        for mode in ("diff", "direct"):
            config = SDP4BitConfig(weight_mode=mode, ranks_per_node=rpn, rounding="nearest")
            model = initial_weights(world, shard, torch.bfloat16)
            own = model[rank * shard:(rank + 1) * shard]
            main = own.float() + 0.01 * torch.randn(
                shard, generator=torch.Generator().manual_seed(70 + rank))
            whole = model.clone()
            quantized_all_gather_weights(whole, main, config=config, async_op=True).wait()
            caps = weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS
            weights.MAX_CHUNK_ELEMENTS = world * config.weight_group_size
            weights.MIN_SLICE_ELEMENTS = config.weight_group_size
            try:
                quantized_all_gather_weights(model, main, config=config)
            finally:
                weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS = caps
            out[(rpn, mode)] = {"same_as_whole": torch.equal(model, whole),
                                "identical": identical_on_all_ranks(model)}
    return out


def test_sliced_gather_equals_the_whole_gather(world):
    for rank, per_case in enumerate(battery.results(sliced, world)):
        assert per_case
        for key, value in per_case.items():
            assert value == {"same_as_whole": True, "identical": True}, f"rank {rank} {key}: {value}"


@battery.case(*WORLDS)
def two_levels_and_flat(rank: int, world: int) -> dict:
    """The same gather flat (one rank a node, or ``weight_gather="flat"``) and in two hops
    (comm/gather_hops.py): the
    segments are the same bytes, moved another way, so the buffers must be equal bit for
    bit; stochastic rounding, 1 and 3 slices, bf16 and fp32, qWD and qW."""
    from megatron_sdp4bit.comm import weights

    out = {}
    caps = weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS
    for rpn in [r for r in ranks_per_node_choices(world) if 1 < r < world]:
        for mode in ("diff", "direct"):
            for dtype, shard, sliced in ((torch.bfloat16, 5000, True), (torch.float32, 3000, False)):
                results = []
                for layout, hops in ((1, "two-level"), (rpn, "flat"), (rpn, "two-level")):
                    config = SDP4BitConfig(weight_mode=mode, ranks_per_node=layout,
                                           weight_gather=hops)
                    model = initial_weights(world, shard, dtype)
                    own = model[rank * shard:(rank + 1) * shard]
                    main = own.float() + 0.01 * torch.randn(
                        shard, generator=torch.Generator().manual_seed(80 + rank))
                    if sliced:  # one group of 2048 a slice: 3 slices, the last padded
                        weights.MAX_CHUNK_ELEMENTS = world * config.weight_group_size
                        weights.MIN_SLICE_ELEMENTS = config.weight_group_size
                    try:
                        quantized_all_gather_weights(
                            model, main, config=config,
                            generator=torch.Generator().manual_seed(90 + rank))
                    finally:
                        weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS = caps
                    results.append(model)
                out[(rpn, mode, str(dtype))] = {
                    "equal": all(torch.equal(results[0], other) for other in results[1:]),
                    "identical": identical_on_all_ranks(results[-1])}
    return out


def test_two_level_gather_equals_the_flat_one_bit_for_bit(world):
    if world == 2:
        pytest.skip("2 ranks make no two-level layout; runs at 4 and 8 ranks")
    for rank, per_case in enumerate(battery.results(two_levels_and_flat, world)):
        assert per_case
        for key, value in per_case.items():
            assert value == {"equal": True, "identical": True}, f"rank {rank} {key}: {value}"


# --- error feedback over many steps (2 ranks per node) -----------------------------------

@battery.case(*STATISTICS_WORLDS)
def error_feedback(rank: int, world: int, steps: int = 30) -> dict:
    """K optimizer-like steps: qWD's error stays flat, qW's does not shrink.

    ``naive`` is the control the error-feedback claim is measured against:
    quantizing each *update* (not the difference to the model) lets the
    rounding errors random-walk, so its error grows with K.
    """
    shard, out = 3000, {}
    for mode in ("diff", "direct", "naive"):
        config = SDP4BitConfig(weight_mode="diff" if mode == "naive" else mode, ranks_per_node=2)
        model = initial_weights(world, shard, torch.bfloat16)
        main = model[rank * shard:(rank + 1) * shard].float()
        gen = torch.Generator().manual_seed(60 + rank)
        errors, identical = [], True
        for _ in range(steps):
            update = 0.01 * torch.randn(shard, generator=gen)
            main = main + update
            if mode == "naive":
                q = quantize(update, bits=4, group_size=2048, generator=gen)
                own = model[rank * shard:(rank + 1) * shard]
                own.copy_(own.float() + dequantize(q, torch.float32))
            else:
                quantized_all_gather_weights(model, main, config=config)
                identical = identical and identical_on_all_ranks(model)
            own = model[rank * shard:(rank + 1) * shard].float()
            errors.append(float((own - main).pow(2).mean().sqrt()))
        out[mode] = {"errors": errors, "identical": identical}
    return out


def test_qwd_error_feedback_keeps_error_flat(stats_world):
    """Over 30 steps qWD's error does not grow, qW's does not shrink, naive grows."""
    for rank, per_mode in enumerate(battery.results(error_feedback, stats_world)):
        qwd, qw, naive = per_mode["diff"], per_mode["direct"], per_mode["naive"]["errors"]
        assert qwd["identical"] and qw["identical"]
        first, last = qwd["errors"][:5], qwd["errors"][-5:]
        assert sum(last) <= 1.3 * sum(first), f"rank {rank}: qWD error grew {first} -> {last}"
        assert sum(qw["errors"][-5:]) >= 0.8 * sum(qw["errors"][:5]), f"rank {rank}: qW shrank"
        assert max(qwd["errors"]) < 0.05 * min(qw["errors"]), "qWD should beat qW by far"
        # The control shows the test can fail: without feedback the error random-walks.
        assert sum(naive[-5:]) > 2 * sum(naive[:5])


# --- bytes on the wire -----------------------------------------------------------------

@battery.case(*WORLDS)
def wire_bytes(rank: int, world: int) -> dict:
    """Byte counters of one bf16 gather per mode (shard a multiple of the group size)."""
    shard, out = 4096, {}
    for rpn in ranks_per_node_choices(world):
        for mode in ("diff", "direct", "off"):
            config = SDP4BitConfig(weight_mode=mode, ranks_per_node=rpn)
            model = initial_weights(world, shard, torch.bfloat16)
            main = model[rank * shard:(rank + 1) * shard].float() + 0.01
            reset_wire_stats()
            quantized_all_gather_weights(model, main, config=config)
            out[(rpn, mode)] = get_wire_stats().as_dict()
    return out


def test_weight_wire_bytes_match_analytic_volume(world):
    """4 + 32/2048 bits per element; exact = bf16 shards; split by where peers live.
    On two levels a rank sends its segment across nodes once per other node, and its
    node's segments (one per node) to each peer on its node (comm/gather_hops.py)."""
    shard, group = 4096, 2048
    per_rank = battery.results(wire_bytes, world)
    for rpn in ranks_per_node_choices(world):
        peers = {"intra": min(rpn, world) - 1, "inter": world - min(rpn, world)}
        nodes = world // min(rpn, world)
        two_level = 1 < rpn < world
        segments = ({"intra": (rpn - 1) * nodes, "inter": nodes - 1} if two_level else peers)
        for mode in ("diff", "direct", "off"):
            for rank, recorded in enumerate(per_rank):
                stats = recorded[(rpn, mode)]
                assert stats["calls"]["all_gather"] == 1
                for level, count in peers.items():
                    got = stats["all_gather"][level]
                    assert got["exact"] == count * shard * 2
                    if mode == "off":
                        assert got["values"] == count * shard * 2
                        continue
                    count = segments[level]
                    assert got["codes"] == count * shard // 2
                    assert got["scales"] == count * shard // group * 4
                    if count:
                        bits = 8 * (got["codes"] + got["scales"]) / got["elements"]
                        assert bits == pytest.approx(4 + 32 / group)
