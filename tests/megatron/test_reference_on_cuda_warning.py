"""A job whose collectives run on CUDA tensors but whose quantization would run the torch
reference (no Triton, or ``SDP4BIT_QUANT_BACKEND=torch``) is told so once: the reference
reads a value back to the host in every quantization, so nothing overlaps."""
from __future__ import annotations


def test_cuda_tensors_on_the_torch_reference_get_one_warning(monkeypatch, caplog):
    """Without Triton (or with SDP4BIT_QUANT_BACKEND=torch) CUDA tensors run the reference,
    which reads a value back to the host in every quantization: nothing overlaps. The layer
    says so once, when DDP is built; on CPU tensors, or with Triton, it says nothing."""
    import logging
    import types

    import torch

    from megatron_sdp4bit import quant
    from megatron_sdp4bit.megatron.layer import say_if_cuda_runs_reference

    def said(device, backend):
        monkeypatch.setenv("SDP4BIT_QUANT_BACKEND", backend)
        state = types.SimpleNamespace(reference_on_cuda_said=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_sdp4bit.megatron.layer"):
            say_if_cuda_runs_reference(state, device)
            say_if_cuda_runs_reference(state, device)  # a second model chunk
        return [r.getMessage() for r in caplog.records]

    monkeypatch.delenv("SDP4BIT_QUANT_BACKEND", raising=False)
    triton_imports = quant._triton_ops() is not None
    assert quant.cuda_runs_reference() is not triton_imports
    lines = said(torch.device("cuda", 0), "torch")
    assert len(lines) == 1 and "runs the torch reference on CUDA" in lines[0]
    assert "do not overlap" in lines[0] and "install Triton" in lines[0]
    assert said(torch.device("cuda", 0), "auto") == ([] if triton_imports else lines)
    assert said(torch.device("cpu"), "torch") == []  # the reference is the CPU's kernels
    assert said(None, "torch") == []  # no bucket with a collective
