"""The experts' bucket groups are warmed up too: a mixture-of-experts model's first step
compiles no kernel variant.

The expert-data-parallel group has other hops than the dense data-parallel group (on 4
ranks as 2 emulated nodes x 2 with expert-parallel 2, each expert-DP group holds one
rank of each node: one 4-bit hop across the nodes, where the dense buckets take an
8-bit hop inside the node first) and other shards, so its collectives launch other
variants. The driver's model with experts is built on 4 gloo ranks (the layer warms
up when megatron's DDP is built), then the collectives a step makes on every bucket
group, dense and expert, are recorded (``harness.warm_up_keys``): every key must be
among the warm-up's.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("recording needs the compiled kernels (not the interpreter)", allow_module_level=True)

from driver_runs import TINY_GPT, driver_world  # noqa: E402

EXPERTS = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2"]
FLAGS = TINY_GPT + EXPERTS + ["--bf16", "--train-iters", "2", "--sdp4bit",
                              "--sdp4bit-ranks-per-node", "2",
                              "--overlap-grad-reduce", "--overlap-param-gather", "--bucket-size", "20000"]


def _world(rank, world_size, root):
    from harness.warm_up_keys import warm_up_coverage
    from megatron_sdp4bit.megatron.installed import INSTALLED
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.setup import set_up

    parts = set_up(parse_args(FLAGS + ["--run-dir", os.path.join(root, "run")]))
    layer = INSTALLED.layer
    adapter = layer.adapter
    results = {}
    for kind, groups_of in (("dense", adapter.ddp_bucket_groups), ("expert", adapter.expert_bucket_groups)):
        groups = [group for chunk in parts.model for group in groups_of(chunk)]
        results[kind] = dict(warm_up_coverage(layer, groups), bucket_groups=len(groups))
    return results


def test_a_step_finds_every_expert_and_dense_kernel_variant_compiled_at_ddp_construction(tmp_path_factory):
    _, results = driver_world(tmp_path_factory, "experts-warm-up", _world, 4, timeout_s=600, start="spawn")
    for rank_results in results:
        for kind, result in rank_results.items():
            assert result["bucket_groups"] >= 1 and result["real"] > 0, f"{kind}: {result}"
            assert result["missing"] == 0, f"{kind}: {result['missing']} of {result['real']} " \
                                           "variants a step launches were not warmed up"
