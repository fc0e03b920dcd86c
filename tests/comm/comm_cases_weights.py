"""Weight all-gather cases (qWD, qW, exact), run inside every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm.error_bounds import weight_bound
from megatron_sdp4bit.comm import get_wire_stats, quantized_all_gather_weights, reset_wire_stats
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.quant import dequantize, quantize

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


def one_step_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """One gather per (mode, bits, dtype, size, sync/async): identical buffers, bounded error."""
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
            handle = quantized_all_gather_weights(model, main, config=config, async_op=async_op)
            if async_op:
                handle.wait()
            key = f"wgt|rpn={rpn}|{mode}|b{bits}|{str(dtype)[6:]}|s={shard}|async={async_op}"
            entry = {"identical": identical_on_all_ranks(model)}
            new_own = model[rank * shard:(rank + 1) * shard].double()
            if mode == "off":
                expected = full_main(main).to(dtype)
                entry["exact"] = torch.equal(model, expected)
            else:
                bound = weight_bound(main, source, bits, config.weight_group_size, dtype)
                entry["ratio"] = float(((new_own - main.double()).abs() / bound).max())
            results[key] = entry


def sliced_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """A synchronous gather of a shard larger than a slice may be (here: a slice is one
    group of 2048, the shard 5000, so 3 slices, the last padded) changes nothing with
    nearest rounding: the same buffer as gathered whole (async), on every rank."""
    from megatron_sdp4bit.comm import weights

    shard = 5000
    for mode in ("diff", "direct"):
        config = SDP4BitConfig(weight_mode=mode, ranks_per_node=rpn, rounding="nearest")
        model = initial_weights(world, shard, torch.bfloat16)
        own = model[rank * shard:(rank + 1) * shard]
        main = own.float() + 0.01 * torch.randn(shard, generator=torch.Generator().manual_seed(70 + rank))
        whole = model.clone()
        quantized_all_gather_weights(whole, main, config=config, async_op=True).wait()
        caps = weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS
        weights.MAX_CHUNK_ELEMENTS = world * config.weight_group_size
        weights.MIN_SLICE_ELEMENTS = config.weight_group_size
        try:
            quantized_all_gather_weights(model, main, config=config)
        finally:
            weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS = caps
        results[f"wgt-sliced|rpn={rpn}|{mode}"] = {
            "same_as_whole": torch.equal(model, whole), "identical": identical_on_all_ranks(model)}


def error_feedback_cases(rank: int, world: int, rpn: int, results: dict, steps: int = 30) -> None:
    """K optimizer-like steps: qWD's error stays flat, qW's does not shrink.

    ``naive`` is the control the error-feedback claim is measured against:
    quantizing each *update* (not the difference to the model) lets the
    rounding errors random-walk, so its error grows with K.
    """
    shard = 3000
    for mode in ("diff", "direct", "naive"):
        config = SDP4BitConfig(weight_mode="diff" if mode == "naive" else mode,
                               ranks_per_node=rpn)
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
        results[f"feedback|rpn={rpn}|{mode}"] = {"errors": errors, "identical": identical}


def weight_wire_cases(rank: int, world: int, rpn: int, results: dict) -> None:
    """Byte counters of one bf16 gather per mode (shard a multiple of the group size)."""
    shard = 4096
    for mode in ("diff", "direct", "off"):
        config = SDP4BitConfig(weight_mode=mode, ranks_per_node=rpn)
        model = initial_weights(world, shard, torch.bfloat16)
        main = model[rank * shard:(rank + 1) * shard].float() + 0.01
        reset_wire_stats()
        quantized_all_gather_weights(model, main, config=config)
        results[f"wire|ag|rpn={rpn}|{mode}"] = get_wire_stats().as_dict()
