"""The driver's GPU-only failure modes, caught on a CPU.

The first run on a GPU crashed twice in its first step: the micro-batches were
never moved to the model's device, and masked-softmax fusion was switched on
although its kernel (Apex's ``scaled_masked_softmax_cuda``) was not installed.
A plain CPU run cannot see either (everything is on the CPU, and the CPU path
never asked for the fusion), so these tests provoke them on purpose:

- the model is moved to the ``meta`` device, where mixing in a CPU tensor
  raises just as mixing one into a CUDA model does, and the driver's own
  ``forward_step`` and loss function run on it;
- the fused-kernel choice is made for ``"cuda"`` with this machine's imports,
  and a bf16 forward whose shapes megatron's fused softmax accepts runs on the
  CPU: with the flag on and no kernel, megatron-core imports it and fails.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import spawn_ranks
from megatron_sdp4bit.training.fusions import Fusions, choose_fusions

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2"]
VOCAB = 100


def _cpu_batch(batch: int, seq: int) -> dict:
    return {"tokens": torch.randint(0, VOCAB, (batch, seq)),
            "labels": torch.randint(0, VOCAB, (batch, seq)),
            "position_ids": torch.arange(seq).repeat(batch, 1),
            "loss_mask": torch.ones(batch, seq)}


def _start_megatron_on_cpu():
    from megatron_sdp4bit.cpu_backend import enable_cpu_backend
    from megatron_sdp4bit.training.distributed import init_model_parallel

    enable_cpu_backend()
    init_model_parallel(seed=1)


def _forward_on_meta_model(rank, world_size):
    from megatron_sdp4bit.training.step import forward_step
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.model import build_gpt

    _start_megatron_on_cpu()
    args = parse_args(TINY)
    model, _ = build_gpt(args, VOCAB, "cpu", Fusions())
    model.to("meta")  # stands in for "cuda": a CPU tensor mixed in raises
    seen = {}

    def record_input_devices(module, args, kwargs):
        tensors = list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        seen["inputs"] = sorted({str(t.device) for t in tensors if isinstance(t, torch.Tensor)})

    model.register_forward_pre_hook(record_input_devices, with_kwargs=True)
    output, loss_func = forward_step(iter([_cpu_batch(2, 64)]), model)
    loss, reported = loss_func(output)
    return {"inputs": seen["inputs"], "output": str(output.device), "loss": str(loss.device),
            "reported": str(reported["lm loss"].device)}


def test_forward_step_puts_the_batch_on_the_models_device():
    result = spawn_ranks(_forward_on_meta_model, 1, timeout_s=300)[0]
    assert result == {"inputs": ["meta"], "output": "meta", "loss": "meta", "reported": "meta"}


def _bf16_forward(rank, world_size, fusions: Fusions):
    from megatron.core.transformer.module import Float16Module

    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.model import build_gpt

    _start_megatron_on_cpu()
    args = parse_args(TINY + ["--bf16"])
    model, config = build_gpt(args, VOCAB, "cpu", fusions)
    model = Float16Module(config, model)
    batch = _cpu_batch(2, 64)  # 2 x 4 heads, 64 x 64 scores: shapes the fused softmax takes
    try:
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    except ModuleNotFoundError as exc:
        return f"missing kernel: {exc.name}"
    return f"ran: {tuple(output.shape)}"


def _kernels_importable(*names) -> bool:
    from megatron_sdp4bit.training.fusions import module_imports

    return all(module_imports(n) for n in names)


@pytest.mark.skipif(_kernels_importable("scaled_masked_softmax_cuda"),
                    reason="Apex's softmax kernel is installed here, so the fused path is legitimately on")
def test_fusions_chosen_for_cuda_run_without_apex():
    chosen = choose_fusions("cuda")  # this machine's imports: no Apex
    assert not chosen.masked_softmax_fusion
    assert not chosen.gradient_accumulation_fusion and not chosen.persist_layer_norm
    # bias-gelu / bias-dropout are torch.compile'd: generating CPU code would take
    # minutes here; scripts/gpu_check.sh runs them on a GPU.
    chosen = dataclasses.replace(chosen, bias_activation_fusion=False, bias_dropout_fusion=False)
    forced = dataclasses.replace(chosen, masked_softmax_fusion=True)  # what the driver did before
    outcomes = spawn_ranks(_bf16_forward, 1, chosen, timeout_s=300) + \
        spawn_ranks(_bf16_forward, 1, forced, timeout_s=300)
    assert outcomes[0].startswith("ran: (2, 64"), outcomes[0]
    assert outcomes[1].startswith("missing kernel: scaled_"), outcomes[1]


def test_fusion_choice_follows_what_imports():
    apex = {"scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
            "scaled_softmax_cuda", "fused_weight_gradient_mlp_cuda", "fast_layer_norm"}
    nothing = choose_fusions("cuda", imports=lambda name: False)
    assert nothing == Fusions()
    with_apex = choose_fusions("cuda", imports=lambda name: name in apex)
    assert with_apex.masked_softmax_fusion and with_apex.gradient_accumulation_fusion
    assert with_apex.persist_layer_norm and not with_apex.bias_activation_fusion
    with_triton = choose_fusions("cuda", imports=lambda name: name == "triton")
    assert with_triton.bias_activation_fusion and with_triton.bias_dropout_fusion
    assert not with_triton.masked_softmax_fusion
    # one missing softmax kernel is enough to keep the fusion off
    partial = choose_fusions("cuda", imports=lambda name: name in apex - {"scaled_softmax_cuda"})
    assert not partial.masked_softmax_fusion
    assert choose_fusions("cpu", imports=lambda name: True) == Fusions()


def test_fusion_line_names_every_fusion():
    line = choose_fusions("cuda", imports=lambda name: name == "triton").describe()
    assert line == ("fused kernels on: bias-gelu, bias-dropout; off: masked softmax, rope, "
                    "grad-accumulation, persistent layer norm")
