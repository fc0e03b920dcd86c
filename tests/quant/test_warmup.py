"""warm_up compiles what the real calls need: after it, a real call finds its variant.

Triton keeps one compiled variant per cache key (constexprs, argument types,
divisibility of sizes and strides, pointer alignment). Here, without a GPU,
``launch_record.recording()`` gives the key each launch would compile under on
sm_90 (Triton's own binder): the keys of the calls the collectives make after
the warm-up, on other buffers (views into larger send/receive buffers, a bucket's
rows, the last pipeline chunk), must all be among the warm-up's keys. On a GPU,
tests/quant/test_triton_chunks.py counts the JIT cache's entries instead.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("recording needs the compiled kernels (not the interpreter)", allow_module_level=True)

from megatron_sdp4bit import quant  # noqa: E402
from megatron_sdp4bit.quant import warmup  # noqa: E402
from megatron_sdp4bit.quant.triton_kernels.launch_record import recording  # noqa: E402
from megatron_sdp4bit.quant.wire import segment_nbytes, wire_view  # noqa: E402

P, L, N = 8, 4, 2  # ranks, ranks per node, nodes
SHARD = 3 * 4096 + 1000  # a bucket's shard: three full pipeline chunks and a padded last one
WEIGHT_SHARD = 5000  # an unaligned weight shard (4 ranks)


def grad_specs(dtype):
    specs = []
    for padded, valid in ((4096, 4096), (1024, 1000)):
        specs += [
            warmup.KernelSpec("hadamard_quantize_rows", P * padded, 8, 128, chunks=L, dtype=dtype,
                              hadamard_block=32, scaled=True, rows=P, row_numel=SHARD,
                              start=4096, valid=valid, ordered=True),
            warmup.KernelSpec("dequantize_sum_requantize", L * N * padded, 8, 128, chunks=L,
                              out_bits=4, out_group_size=128, out_chunks=N),
            warmup.KernelSpec("dequantize_sum", N * padded, 4, 128, chunks=N, hadamard_block=32,
                              dtype=dtype if valid == padded else torch.float32),
        ]
    return specs


WEIGHT_SPECS = [
    warmup.KernelSpec("quantize_weight_diff", WEIGHT_SHARD, 4, 2048, dtype=torch.bfloat16),
    warmup.KernelSpec("dequantize_add_", 4 * WEIGHT_SHARD, 4, 2048, chunks=4, dtype=torch.bfloat16),
]


def _keys(run) -> set:
    with recording() as launches:
        run()
    return {launch.key for launch in launches}


def _buffer(nbytes: int, device="cpu") -> torch.Tensor:
    """A preallocated communication buffer, larger than one hop needs (reused)."""
    return torch.zeros(nbytes + 4096, dtype=torch.uint8, device=device)


def reduce_scatter_calls(dtype, shard=SHARD, device="cpu"):
    """The quantized reduce-scatter's kernels, chunk by chunk, as the collective makes them."""
    grads = torch.randn(64 + P * shard, device=device).to(dtype)[64:]  # a bucket in a grad buffer
    rows = grads.view(P, shard)
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=device)
    gen = torch.Generator(device).manual_seed(0)
    output = torch.zeros(shard, dtype=dtype, device=device)
    for start in range(0, shard, 4096):
        valid = min(4096, shard - start)
        padded = -(-valid // 128) * 128
        send = wire_view(_buffer(L * segment_nbytes(N * padded, 8, 128), device), L, N * padded,
                         8, 128)
        quant.hadamard_quantize_rows(rows, order, start, valid, padded, 8, 128, 32, "stochastic",
                                     gen, 1 / P, out=send)
        received = wire_view(_buffer(L * segment_nbytes(N * padded, 8, 128), device), L,
                             N * padded, 8, 128)
        send2 = wire_view(_buffer(N * segment_nbytes(padded, 4, 128), device), N, padded, 4, 128)
        quant.dequantize_sum_requantize(received, L, 4, 128, "stochastic", gen, out=send2)
        received2 = wire_view(_buffer(N * segment_nbytes(padded, 4, 128), device), N, padded, 4,
                              128)
        if valid == padded:
            quant.dequantize_sum(received2, N, 32, out=output[start:start + valid])
        else:
            quant.dequantize_sum(received2, N, 32)


def weight_gather_calls(shard=WEIGHT_SHARD, device="cpu"):
    model = torch.zeros(4 * shard, dtype=torch.bfloat16, device=device)
    main = torch.randn(shard, device=device)
    send = wire_view(_buffer(segment_nbytes(shard, 4, 2048), device), 1, shard, 4, 2048)
    quant.quantize_weight_diff(main, model[2 * shard: 3 * shard], 4, 2048, "stochastic",
                               torch.Generator(device).manual_seed(1), out=send)
    received = wire_view(_buffer(4 * segment_nbytes(shard, 4, 2048), device), 4, shard, 4, 2048)
    quant.dequantize_add_(model, received)


@pytest.fixture(autouse=True)
def _triton_backend_on_cpu(monkeypatch):
    """The dispatcher sends CPU tensors to the Triton ops while a recording runs."""
    from megatron_sdp4bit.quant import triton_ops
    monkeypatch.setattr(quant, "backend_for", lambda t: triton_ops)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduce_scatter_calls_compile_nothing_after_the_warm_up(dtype):
    warmed = _keys(lambda: [warmup.run_spec(spec, "cpu") for spec in grad_specs(dtype)])
    real = _keys(lambda: reduce_scatter_calls(dtype))
    assert len(real) == 6 and real <= warmed, "a real call needs a variant the warm-up did not compile"


def test_weight_gather_calls_compile_nothing_after_the_warm_up():
    warmed = _keys(lambda: [warmup.run_spec(spec, "cpu") for spec in WEIGHT_SPECS])
    real = _keys(weight_gather_calls)
    assert len(real) == 2 and real <= warmed


def test_recording_works_with_the_compilation_knobs_of_an_older_triton(monkeypatch):
    """Triton 3.6 (the lent GPUs' release) has no ``fpsan_homomorphic_casts`` knob, which
    JITFunction.run passes from 3.9 on; the recorder read it unconditionally, so
    compile_check (a gpu_check step) failed there before compiling anything."""
    import triton

    class OlderKnobs:
        def __init__(self, knobs):
            self._knobs = knobs

        def __getattr__(self, name):
            if name == "fpsan_homomorphic_casts":
                raise AttributeError(name)
            return getattr(self._knobs, name)

    monkeypatch.setattr(triton.knobs, "compilation", OlderKnobs(triton.knobs.compilation))
    # (Not the same keys as 3.9's: its options then lack the knob, which its own run passes.)
    assert len(_keys(weight_gather_calls)) == 2


def test_the_keys_tell_variants_apart():
    # Rows at a stride divisible by 16 (SHARD is not), a shard of another size class:
    # other variants, so the checks above would catch a warm-up that got a layout wrong.
    assert SHARD % 16 and (SHARD + 8) % 16 == 0 and WEIGHT_SHARD % 16 and (WEIGHT_SHARD + 8) % 16 == 0
    warmed = _keys(lambda: [warmup.run_spec(spec, "cpu") for spec in grad_specs(torch.float32)])
    assert not _keys(lambda: reduce_scatter_calls(torch.float32, shard=SHARD + 8)) <= warmed
    assert not _keys(lambda: weight_gather_calls(shard=WEIGHT_SHARD + 8)) <= _keys(
        lambda: [warmup.run_spec(spec, "cpu") for spec in WEIGHT_SPECS])


def test_warm_up_does_nothing_where_the_reference_serves(monkeypatch):
    monkeypatch.undo()  # the real dispatcher: CPU tensors go to the reference
    assert warmup.warm_up(grad_specs(torch.float32) + WEIGHT_SPECS, "cpu") == 0.0
    # Inside a recording the dispatcher sends every device to the Triton ops (what a GPU
    # would launch), unless the reference is forced; then nothing is recorded either.
    monkeypatch.setenv("SDP4BIT_QUANT_BACKEND", "torch")
    with recording() as launches:
        assert warmup.warm_up(grad_specs(torch.float32) + WEIGHT_SPECS, "cpu") == 0.0
    assert launches == []


def test_inside_a_recording_the_dispatcher_sends_cpu_tensors_to_the_triton_ops(monkeypatch):
    from megatron_sdp4bit.quant import triton_ops

    monkeypatch.undo()
    assert quant.backend_for(torch.empty(0)) is not triton_ops
    with recording():
        assert quant.backend_for(torch.empty(0)) is triton_ops


@pytest.mark.parametrize("field,value,message", [
    ("op", "dequantise", "use one of"), ("numel", 0, "positive"), ("chunks", 3, "multiple of chunks"),
    ("bits", 3, "bits=3"), ("rounding", "up", "rounding")])
def test_bad_specs_are_refused_naming_the_field(field, value, message):
    args = dict(op="quantize", numel=4096, bits=4, group_size=2048)
    args[field] = value
    with pytest.raises(ValueError, match=message):
        warmup.KernelSpec(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts the JIT cache on a GPU")
def test_on_a_gpu_the_jit_cache_gains_no_entry_after_the_warm_up(monkeypatch):
    from megatron_sdp4bit.quant.triton_kernels.dequantize_kernel import dequantize_kernel
    from megatron_sdp4bit.quant.triton_kernels.quantize_kernel import quantize_kernel
    monkeypatch.undo()  # the real dispatcher: CUDA tensors go to the Triton ops
    device = torch.device("cuda")
    specs = grad_specs(torch.bfloat16) + grad_specs(torch.float32) + WEIGHT_SPECS
    assert warmup.warm_up(specs, device) > 0

    def entries():
        index = torch.cuda.current_device()
        return sum(len(kernel.device_caches[index][0]) for kernel in (quantize_kernel, dequantize_kernel))

    compiled = entries()
    for dtype in (torch.bfloat16, torch.float32):
        reduce_scatter_calls(dtype, device=device)
    weight_gather_calls(device=device)
    torch.cuda.synchronize()
    assert entries() == compiled, "a real call compiled a variant the warm-up had not"
