"""The first training step compiles nothing: the layer warms up, when DDP is built, the
kernel variants its collectives will launch.

Triton compiles one variant per cache key (constexprs, argument types, divisibility
of sizes and strides). Without a GPU, ``launch_record.recording()`` yields the key
each launch would compile under on sm_90 (Triton's own binder), with nothing run.
On 4 gloo ranks as 2 emulated nodes x 2 (both hops of TLq-HS), for each layout:
the layer installed, megatron's DDP and optimizer built (the layer records the specs
it warmed up), then the collectives the layer makes in a step are recorded on the
model's own buckets. Every key of those real calls must be among the warm-up's.
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


def _keys(run) -> set:
    from megatron_sdp4bit.quant.triton_kernels.launch_record import recording

    with recording() as launches:
        run()
    return {launch.key for launch in launches}


def _real_calls(layer, trainer):
    """The collectives the layer makes in a step, on the model's own buckets."""
    import torch

    from megatron_sdp4bit import comm

    state, adapter = layer.state, layer.adapter
    for bucket_group in adapter.ddp_bucket_groups(trainer.model):
        group, size, rank = adapter.collective_group(bucket_group)
        ddp_config = adapter.ddp_config(bucket_group)
        for bucket in adapter.group_buckets(bucket_group):
            grads, params = adapter.bucket_grad_data(bucket), adapter.bucket_param_data(bucket)
            shard = grads.numel() // size
            handle = comm.quantized_reduce_scatter(
                grads[rank * shard:(rank + 1) * shard], grads, group=group, config=state.config,
                async_op=bool(ddp_config.overlap_grad_reduce),
                generator=state.generator(grads.device, "grads"))
            if handle is not None:
                handle.wait()
            main = torch.zeros(params.numel() // size, dtype=torch.float32)
            for async_op in {False, bool(ddp_config.overlap_param_gather)}:
                handle = comm.quantized_all_gather_weights(
                    params, main, group=group, config=state.config, async_op=async_op,
                    generator=state.generator(main.device, "weights"))
                if handle is not None:
                    handle.wait()


def _world(rank, world_size):
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit import quant
    from megatron_sdp4bit.megatron import patch
    from megatron_sdp4bit.quant import triton_ops, warmup

    results = {}
    for name, (spec, config) in SPECS.items():
        patch.uninstall()
        layer = patch.install(config)
        trainer = TinyGPTTrainer(spec)
        specs = sorted(layer.state.warmed_up, key=repr)
        dispatch = quant.backend_for
        quant.backend_for = lambda t: triton_ops  # CPU tensors to the Triton ops: recorded
        try:
            warmed = _keys(lambda: [warmup.run_spec(s, "cpu") for s in specs])
            real = _keys(lambda: _real_calls(layer, trainer))
        finally:
            quant.backend_for = dispatch
        results[name] = {"specs": len(specs), "real": len(real), "missing": len(real - warmed)}
        patch.uninstall()
    return results


def test_a_step_finds_every_kernel_variant_compiled_at_ddp_construction():
    for rank_results in spawn_ranks(_world, 4, timeout_s=600):
        for name, result in rank_results.items():
            assert result["specs"] > 0 and result["real"] > 0, f"{name}: {result}"
            assert result["missing"] == 0, f"{name}: {result['missing']} of {result['real']} " \
                                           "variants a step launches were not warmed up"
