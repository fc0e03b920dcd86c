"""Which of megatron-core's fused kernels this run can use.

megatron-core's ``TransformerConfig`` flags switch fused kernels on, but several
of those kernels are compiled extensions that ship with Apex (or Megatron-LM's
own build), not with megatron-core: a flag set without its kernel crashes in the
first forward or backward step (``ModuleNotFoundError: scaled_masked_softmax_cuda``
on a GPU box without Apex). So each fusion is switched on only where the
kernel it needs imports, and only on CUDA: on the CPU the unfused paths are the
ones megatron-core runs (and the ones the bit-exact tests compare).

- masked softmax: Apex's ``scaled_masked_softmax_cuda`` and friends;
- bias-gelu and bias-dropout-add: megatron's ``jit_fuser`` (``torch.compile``),
  which needs Triton to generate CUDA code;
- rope: Transformer Engine's fused rotary embedding, as megatron-core imports it
  (unused with the driver's learned absolute positions, reported all the same);
- gradient-accumulation fusion: Apex's ``fused_weight_gradient_mlp_cuda``;
- persistent layer norm: Apex's ``fast_layer_norm``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Callable, Sequence

# What each fusion needs: alternatives, each a tuple of "module" or "module:attribute"
# that must all import.
_KERNELS = {
    "masked_softmax_fusion": (("scaled_masked_softmax_cuda",
                               "scaled_upper_triang_masked_softmax_cuda",
                               "scaled_softmax_cuda"),),
    "bias_activation_fusion": (("triton",),),
    "bias_dropout_fusion": (("triton",),),
    "apply_rope_fusion": (("megatron.core.extensions.transformer_engine:fused_apply_rotary_pos_emb",),),
    "gradient_accumulation_fusion": (("fused_weight_gradient_mlp_cuda",),),
    "persist_layer_norm": (("fast_layer_norm",),),
}

_NAMES = {
    "masked_softmax_fusion": "masked softmax",
    "bias_activation_fusion": "bias-gelu",
    "bias_dropout_fusion": "bias-dropout",
    "apply_rope_fusion": "rope",
    "gradient_accumulation_fusion": "grad-accumulation",
    "persist_layer_norm": "persistent layer norm",
}


def module_imports(name: str) -> bool:
    """True when ``import module`` succeeds (and, for ``module:attribute``, the
    module has that attribute). Any failure counts as missing: a compiled
    extension built for another torch raises more than ImportError."""
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - a broken install is as good as none here
        return False
    return not attribute or getattr(module, attribute, None) is not None


@dataclass(frozen=True)
class Fusions:
    """The fused-kernel flags of megatron-core's TransformerConfig, as chosen."""

    masked_softmax_fusion: bool = False
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    persist_layer_norm: bool = False

    def as_config_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        """One line: which fusions are on and which are off."""
        on = [_NAMES[f.name] for f in fields(self) if getattr(self, f.name)]
        off = [_NAMES[f.name] for f in fields(self) if not getattr(self, f.name)]
        return f"fused kernels on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"


def _available(alternatives: Sequence[Sequence[str]], imports: Callable[[str], bool]) -> bool:
    return any(all(imports(module) for module in modules) for modules in alternatives)


def choose_fusions(device: str, imports: Callable[[str], bool] = module_imports) -> Fusions:
    """Every fusion whose kernel imports, on CUDA; none on the CPU.

    ``imports`` decides whether a module imports (tests pass a stand-in to
    choose as a GPU box with or without Apex would).
    """
    if device != "cuda":
        return Fusions()
    return Fusions(**{flag: _available(alternatives, imports) for flag, alternatives in _KERNELS.items()})
