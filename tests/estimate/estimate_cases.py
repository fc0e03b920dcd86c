"""Real collectives whose recorded bytes the estimator must reproduce (run on gloo ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sdp4bit.comm import (get_wire_stats, quantized_all_gather_weights,
                                   quantized_reduce_scatter, reset_wire_stats)
from megatron_sdp4bit.config import preset

# (name, config overrides) of the collectives measured; shard sizes and dtypes below.
CONFIGS = {
    "baseline": ("baseline", {}),
    "zeropp": ("zeropp", {}),
    "sdp4bit": ("sdp4bit", {}),
    "sdp4bit-3chunks": ("sdp4bit", {"pipeline_chunks": 3}),
    "tlq-g256": ("sdp4bit", {"grad_mode": "tlq", "grad_group_size_intra": 256,
                             "grad_group_size_inter": 64, "weight_group_size": 512}),
}
SHARDS = (1, 37, 4096 + 5)
RANKS_PER_NODE = (1, 2, 3, 4)  # 4 ranks: 4 nodes, 2 x 2, uneven 3 + 1 (flat fallback), 1 node


def cases():
    """(config name, ranks per node, shard, dtype): every config in fp32, two in bf16 too."""
    for rpn in RANKS_PER_NODE:
        for name in CONFIGS:
            for shard in SHARDS:
                yield name, rpn, shard, torch.float32
                if name in ("baseline", "sdp4bit"):
                    yield name, rpn, shard, torch.bfloat16


def _counters() -> dict:
    stats = get_wire_stats()
    return {(c, lv): (stats.sent_bytes(c, lv), stats.exact_bytes(c, lv))
            for c in ("reduce_scatter", "all_gather") for lv in ("intra", "inter")}


def measure(rank: int, world: int) -> dict:
    """{(config, rpn, shard, dtype name): {(collective, level): (sent, exact)}} on this rank."""
    out = {}
    for name, rpn, shard, dtype in cases():
        base, overrides = CONFIGS[name]
        config = preset(base, ranks_per_node=rpn, **overrides)
        grads = torch.randn(world * shard).to(dtype)
        reset_wire_stats()
        quantized_reduce_scatter(torch.empty(shard, dtype=dtype), grads,
                                 op=dist.ReduceOp.AVG, config=config)
        model = torch.zeros(world * shard, dtype=dtype)
        quantized_all_gather_weights(model, torch.randn(shard), config=config)
        out[(name, rpn, shard, str(dtype))] = _counters()
    return out


# (ranks per node, shard, chunk cap): collectives whose calls the estimator must count; a
# cap of 4096 elements splits a 4 x 4101 reduce-scatter into 5 chunks, the gather into 3.
CALL_CASES = [(rpn, shard, cap) for rpn in (1, 2, 4) for shard in (37, 4101)
              for cap in (4096, 1 << 22)]
FLOORS = (1, 2048)  # the chunk and slice floors lowered with the cap, so that caps bite
# The runner for one hardware queue's limits (``whole_bucket_elements``): above the
# 4 x 4101-element buckets (taken whole), and below them (chunks of the cap).
ONE_QUEUE_LIMITS = (1 << 26, 1000)


def count_calls(rank: int, world: int, limits=(None,)) -> dict:
    """{(rpn, shard, cap, limit): (all-to-all calls of one SDP4Bit reduce-scatter, all-gather
    calls of one quantized weight gather)} with ``MAX_CHUNK_ELEMENTS`` set to ``cap``:
    synchronous (limit None), or submitted to a ``DeferringRunner`` with that
    ``whole_bucket_elements`` and waited for."""
    from megatron_sdp4bit.comm import gradients, reduce_scatter_plan, weights
    from megatron_sdp4bit.comm.deferring_runner import DeferringRunner

    counts = {"a2a": 0, "ag": 0}
    a2a, ag, caps = gradients.all_to_all_equal, weights.all_gather_flat, (
        reduce_scatter_plan.MAX_CHUNK_ELEMENTS, weights.MAX_CHUNK_ELEMENTS,
        reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS, weights.MIN_SLICE_ELEMENTS)

    def counting(key, fn):
        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    def run(call, runner):
        handle = call(async_op=runner is not None, runner=runner)
        if handle is not None:
            handle.wait()

    gradients.all_to_all_equal, weights.all_gather_flat = counting("a2a", a2a), counting("ag", ag)
    out = {}
    try:
        for (rpn, shard, cap), limit in ((case, limit) for case in CALL_CASES for limit in limits):
            reduce_scatter_plan.MAX_CHUNK_ELEMENTS = weights.MAX_CHUNK_ELEMENTS = cap
            reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS, weights.MIN_SLICE_ELEMENTS = FLOORS
            config = preset("sdp4bit", ranks_per_node=rpn)
            runner = None if limit is None else DeferringRunner(torch.device("cpu"), limit)
            counts.update(a2a=0, ag=0)
            run(lambda **kw: quantized_reduce_scatter(
                torch.empty(shard), torch.randn(world * shard), op=dist.ReduceOp.AVG,
                config=config, **kw), runner)
            rs = counts["a2a"]
            run(lambda **kw: quantized_all_gather_weights(
                torch.zeros(world * shard, dtype=torch.bfloat16), torch.randn(shard),
                config=config, **kw), runner)
            out[(rpn, shard, cap, limit)] = (rs, counts["ag"])
    finally:
        gradients.all_to_all_equal, weights.all_gather_flat = a2a, ag
        (reduce_scatter_plan.MAX_CHUNK_ELEMENTS, weights.MAX_CHUNK_ELEMENTS,
         reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS, weights.MIN_SLICE_ELEMENTS) = caps
    return out
