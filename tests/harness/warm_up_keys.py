"""Inside a rank: does the layer's warm-up cover every kernel variant a step launches?

Triton compiles one variant per cache key (constexprs, argument types, divisibility of
sizes and strides). Without a GPU, ``launch_record.recording()`` yields the key each
launch would compile under on sm_90 (Triton's own binder), with nothing run.
``warm_up_coverage(layer, bucket_groups)`` records the keys of the specs the layer
warmed up, then the keys of the collectives a step makes on ``bucket_groups``' own
buckets (each bucket's reduce-scatter, and its weight gather sync and, where
overlapped, async), and counts the real keys the warm-up missed.
"""
from __future__ import annotations


def _keys(run) -> set:
    from megatron_sdp4bit.quant.triton_kernels.launch_record import recording

    with recording() as launches:
        run()
    return {launch.key for launch in launches}


def _real_calls(layer, bucket_groups) -> None:
    import torch

    from megatron_sdp4bit import comm

    state, adapter = layer.state, layer.adapter
    for bucket_group in bucket_groups:
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
            if params is None:
                continue
            main = torch.zeros(params.numel() // size, dtype=torch.float32)
            for async_op in {False, bool(ddp_config.overlap_param_gather)}:
                handle = comm.quantized_all_gather_weights(
                    params, main, group=group, config=state.config, async_op=async_op,
                    generator=state.generator(main.device, "weights"))
                if handle is not None:
                    handle.wait()


def warm_up_coverage(layer, bucket_groups) -> dict:
    """``{"specs", "real", "missing"}``: specs warmed up, distinct keys the real calls on
    ``bucket_groups`` launch, and how many of those the warm-up did not compile. The
    Triton ops serve CPU tensors meanwhile (recorded, not run)."""
    from megatron_sdp4bit import quant
    from megatron_sdp4bit.quant import triton_ops, warmup

    specs = sorted(layer.state.warmed_up, key=repr)
    dispatch = quant.backend_for
    quant.backend_for = lambda t: triton_ops
    try:
        warmed = _keys(lambda: [warmup.run_spec(s, "cpu") for s in specs])
        real = _keys(lambda: _real_calls(layer, bucket_groups))
    finally:
        quant.backend_for = dispatch
    return {"specs": len(specs), "real": len(real), "missing": len(real - warmed)}
