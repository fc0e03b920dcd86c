"""What Megatron-LM's arguments must say for a CPU run (redirect 11 of ``megatron_training.py``).

Without a GPU, Megatron-LM's defaults fail on every rank: 0.19's ``--transformer-impl``
default, Transformer Engine, is not installed (``TypeError: 'NoneType' object is not
callable`` when the model is built), the fused kernels are Apex / CUDA code
(``AssertionError: persist_layer_norm not supported by torch LayerNorm`` and the like),
and NCCL has no CPU tensors; tensor parallelism asserted ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
The CPU mode sets these before Megatron-LM validates the arguments, and rank 0 says in one
line which it set.
"""
from __future__ import annotations

import os
from typing import Any, List, MutableMapping

CPU_SETTINGS = (
    ("--transformer-impl local", "transformer_impl", "local"),
    ("--no-persist-layer-norm", "no_persist_layer_norm", True),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False),
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", False),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", False),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", False),
    ("--no-rope-fusion", "apply_rope_fusion", False),
    ("--distributed-backend gloo", "distributed_backend", "gloo"),
)
"""11. (flag, Megatron-LM's ``args`` name, value): what a CPU run needs. Transformer Engine,
Apex and the fused kernels are GPU code, and NCCL has no CPU tensors. Each "off" can only
be asked for (``--no-...``), never forced on, so setting it overrides no choice."""


CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
"""``validate_args`` requires it to be 1 for tensor or context parallelism on a device
before Blackwell, which is what the CPU reports (redirect 6); on CPU it means nothing."""


def settle_args_for_cpu(args: Any, environ: MutableMapping[str, str] = os.environ) -> List[str]:
    """Set ``CPU_SETTINGS`` on Megatron-LM's parsed ``args``, and ``CONNECTIONS=1`` in
    ``environ`` where tensor or context parallelism asks for it; what changed, as flags."""
    changed = []
    for flag, name, value in CPU_SETTINGS:
        if hasattr(args, name) and getattr(args, name) != value:
            setattr(args, name, value)
            changed.append(flag)
    model_parallel = any((getattr(args, name, 1) or 1) > 1 for name in
                         ("tensor_model_parallel_size", "context_parallel_size"))
    if model_parallel and environ.get(CONNECTIONS) != "1":
        environ[CONNECTIONS] = "1"
        changed.append(f"{CONNECTIONS}=1")
    return changed
