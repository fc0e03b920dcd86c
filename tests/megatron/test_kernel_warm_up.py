"""The first training step compiles nothing: the layer warms up, when DDP is built, the
kernel variants its collectives will launch.

On 4 gloo ranks as 2 emulated nodes x 2 (both hops of TLq-HS), for each layout:
the layer installed, megatron's DDP and optimizer built (the layer records the specs
it warmed up), then the collectives the layer makes in a step are recorded on the
model's own buckets (``harness.warm_up_keys``). Every key of those real calls must be
among the warm-up's. The experts' bucket groups: ``tests/training/test_experts_warm_up.py``.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("recording needs the compiled kernels (not the interpreter)", allow_module_level=True)

from harness import spawn_ranks  # noqa: E402
from harness.tiny_gpt import TinyGPTSpec  # noqa: E402
from megatron_sdp4bit.config import preset  # noqa: E402

SPECS = {
    "bf16": (TinyGPTSpec(dtype="bf16"), preset("sdp4bit", ranks_per_node=2)),
    "fp32-overlap-both": (TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True,
                                      overlap_param_gather=True, bucket_size=4000),
                          preset("sdp4bit", ranks_per_node=2, pipeline_chunks=3)),
    "zeropp-bf16": (TinyGPTSpec(dtype="bf16"), preset("zeropp", ranks_per_node=2)),
}


def _world(rank, world_size):
    from harness.tiny_gpt import TinyGPTTrainer
    from harness.warm_up_keys import warm_up_coverage
    from megatron_sdp4bit.megatron import patch

    results = {}
    for name, (spec, config) in SPECS.items():
        patch.uninstall()
        layer = patch.install(config)
        trainer = TinyGPTTrainer(spec)
        results[name] = warm_up_coverage(layer, layer.adapter.ddp_bucket_groups(trainer.model))
        patch.uninstall()
    return results


def test_a_step_finds_every_kernel_variant_compiled_at_ddp_construction():
    for rank_results in spawn_ranks(_world, 4, timeout_s=600):
        for name, result in rank_results.items():
            assert result["specs"] > 0 and result["real"] > 0, f"{name}: {result}"
            assert result["missing"] == 0, f"{name}: {result['missing']} of {result['real']} " \
                                           "variants a step launches were not warmed up"
