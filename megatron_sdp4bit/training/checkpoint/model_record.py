"""The model a checkpoint holds, by the flags that shape it, and the rule that refuses
another.

Another ``--num-attention-heads`` gives the same parameter shapes: its checkpoint
loaded without a word and the resumed run computed attention over other heads.
Another ``--hidden-size`` or ``--num-layers`` failed in megatron's loader (a raw
size-mismatch traceback with the plain optimizer) or as "optimizer buckets" that
differ. The record comes from the model itself (megatron's TransformerConfig and
GPTModel), so it is what was built, whatever the flags said.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from megatron_sdp4bit.training.checkpoint.common import CheckpointError, first_line

# (recorded field, its flag); a flag without a value is written as itself or "no FLAG"
_FLAGS = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"), ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"), ("max_position_embeddings", "--max-position-embeddings"),
    ("untied_embeddings", "--untie-embeddings-and-output-weights"),
    ("layers_per_virtual_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("transformer_impl", "--transformer-impl"),
    ("num_experts", "--num-experts"), ("moe_router_topk", "--moe-router-topk"),
)


def _written(flag: str, value) -> str:
    if value is True:
        return flag
    return f"no {flag}" if value in (None, False) else f"{flag} {value}"


def _this_runs(flag: str, value) -> str:
    return str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else _written(flag, value)


def model_record(model) -> dict:
    """The flags that shaped this rank's model (JSON-ready)."""
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]  # virtual stages
    config = get_attr_wrapped_model(chunks[0], "config")
    stages = parallel_state.get_pipeline_model_parallel_world_size() \
        if parallel_state.model_parallel_is_initialized() else 1
    return {
        "num_layers": config.num_layers, "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.ffn_hidden_size, "num_attention_heads": config.num_attention_heads,
        "max_position_embeddings": get_attr_wrapped_model(chunks[0], "max_sequence_length"),
        "untied_embeddings": not get_attr_wrapped_model(chunks[0], "share_embeddings_and_output_weights"),
        "layers_per_virtual_stage": config.num_layers // (stages * len(chunks)) if len(chunks) > 1 else None,
        # Transformer Engine's layers fuse the layer norms into the linear layers: other
        # parameters, other names (a GPU checkpoint resumed where TE is missing).
        "transformer_impl": "transformer_engine" if any(type(m).__name__.startswith("TE")
                                                        for m in chunks[0].modules()) else "local",
        "num_experts": config.num_moe_experts,
        "moe_router_topk": config.moe_router_topk if config.num_moe_experts else None,
    }


def compare_models(directory: str, saved: Optional[dict], now: Optional[dict]) -> None:
    """Refuse, in one line naming each flag with both values, a checkpoint of another
    model (nothing is compared where either record is missing)."""
    if not saved or not now:
        return
    differences: List[tuple] = [(_written(flag, saved[key]), _this_runs(flag, now[key]))
                                for key, flag in _FLAGS if key in saved and saved[key] != now[key]]
    if differences:
        flags = [a for a, _ in differences if not a.startswith("no ")]
        without = [a[len("no "):] for a, _ in differences if a.startswith("no ")]
        fix = " and ".join(([f"with {' '.join(flags)}"] if flags else []) +
                           ([f"without {' '.join(without)}"] if without else []))
        raise CheckpointError(
            f"checkpoint {directory} was saved with {', '.join(f'{a} (this run: {b})' for a, b in differences)}: "
            f"another model; resume {fix}")


def load_model(model, state: dict, directory: str) -> None:
    """The checkpoint's weights into ``model``; keys or shapes that differ (a checkpoint
    saved before the model was recorded) are a ``CheckpointError`` in one line, not
    torch's report of every key."""
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        found = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()] or [first_line(exc)]
        shown = found[0] if len(found[0]) <= 200 else found[0][:200] + " ..."
        raise CheckpointError(f"checkpoint {directory} holds another model than this run builds ({shown}): "
                              "resume with the model flags it was saved with (--num-layers, --hidden-size, "
                              "--transformer-impl, ...)") from exc
