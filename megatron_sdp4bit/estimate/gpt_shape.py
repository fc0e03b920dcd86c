"""The GPT being trained: shape from a config file, parameter tensors per rank, FLOPs.

The shape is read from the same YAML files and with the same flag names as the
pre-training driver (``configs/gpt_*.yaml``, parsed by
``megatron_sdp4bit.training.arguments``), so ``--config`` means the same thing
to both. The parameter tensors are those of megatron-core's ``GPTModel`` with
learned absolute position embeddings, LayerNorm with bias and biased linear
layers (the driver's model), split the way Megatron splits them over tensor
(TP) and pipeline (PP) parallel ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from megatron_sdp4bit.training.vocab import padded_vocab_size

# GPT-2's BPE vocabulary (vocab.json) has 50257 entries; Megatron-LM pads it.
GPT2_BPE_VOCAB_SIZE = 50257


class ModelError(ValueError):
    """The config or an override does not describe a model the estimator can split.

    ``flag`` names the command-line flag to change.
    """

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class ModelShape:
    """The GPT and batch of one training step."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int  # before padding
    untied_embeddings: bool
    micro_batch_size: int
    global_batch_size: Optional[int]  # None: micro-batch x DP (the driver's default)
    tensor_parallel: int = 1  # the config's TP and PP sizes (the command line may override them)
    pipeline_parallel: int = 1

    def padded_vocab(self, tp: int) -> int:
        """Megatron-LM pads the vocabulary to a multiple of 128 x TP."""
        return padded_vocab_size(self.vocab_size, tp)

    def with_overrides(self, **changes) -> "ModelShape":
        changes = {k: v for k, v in changes.items() if v is not None}
        shape = replace(self, **changes)
        if "hidden_size" in changes and "ffn_hidden_size" not in changes:
            shape = replace(shape, ffn_hidden_size=4 * shape.hidden_size)
        if "seq_length" in changes and shape.max_position_embeddings < shape.seq_length:
            shape = replace(shape, max_position_embeddings=shape.seq_length)
        return shape


def _vocab_for(args) -> Optional[int]:
    tokenizer = (args.tokenizer_type or "").lower()
    if tokenizer in ("gpt2bpetokenizer", "gpt2"):
        return GPT2_BPE_VOCAB_SIZE
    if not tokenizer:  # the driver's default: the embedded corpus and its tokenizer
        from megatron_sdp4bit.data.corpus import DEFAULT_VOCAB_SIZE

        return DEFAULT_VOCAB_SIZE
    return None  # HuggingFace tokenizers: only the tokenizer file knows; ask for --vocab-size


def load_model_shape(config_path: Optional[str], vocab_size: Optional[int] = None,
                     driver_argv: Sequence[str] = ()) -> ModelShape:
    """The model of a driver config file (``None``: the driver's defaults) and driver flags
    (``driver_argv``, overriding the file), read as the driver reads them.

    Raises ``ModelError`` (flag ``--config``) for a missing file or unknown key.
    """
    from megatron_sdp4bit.training.arguments import ArgumentError, build_parser, yaml_to_argv

    if config_path == "":  # `--config "$CONFIG"` with CONFIG unset: not the driver's defaults
        raise ModelError("--config", "--config was given an empty path (an empty variable?): pass the YAML file, "
                         "or drop --config to estimate the driver's default model")
    parser = build_parser()
    try:
        argv = yaml_to_argv(config_path, parser) if config_path else []
        args = parser.parse_args(argv + list(driver_argv))
    except ArgumentError as exc:
        message = str(exc)
        raise ModelError("--config", message if message.startswith("--config")
                         else f"--config {config_path}: {message}") from None
    vocab = vocab_size if vocab_size is not None else _vocab_for(args)
    if vocab is None:
        raise ModelError("--vocab-size", f"--config {config_path} uses tokenizer "
                         f"{args.tokenizer_type}: give its vocabulary size with --vocab-size")
    name = "driver defaults" if not config_path else config_path.rsplit("/", 1)[-1]
    return ModelShape(
        name=name,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        seq_length=args.seq_length,
        max_position_embeddings=max(args.max_position_embeddings or args.seq_length,
                                    args.seq_length),
        vocab_size=vocab,
        untied_embeddings=bool(args.untie_embeddings_and_output_weights),
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        tensor_parallel=args.tensor_model_parallel_size,
        pipeline_parallel=args.pipeline_model_parallel_size,
    )


# --- parameters -----------------------------------------------------------------------

def _layer_tensors(shape: ModelShape, tp: int) -> List[Tuple[str, int]]:
    """One transformer layer's parameters on one TP rank, in ``named_parameters`` order."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return [
        ("input_layernorm.weight", h), ("input_layernorm.bias", h),
        ("self_attention.linear_proj.weight", h * h // tp), ("self_attention.linear_proj.bias", h),
        ("self_attention.linear_qkv.weight", 3 * h * h // tp),
        ("self_attention.linear_qkv.bias", 3 * h // tp),
        ("pre_mlp_layernorm.weight", h), ("pre_mlp_layernorm.bias", h),
        ("mlp.linear_fc1.weight", f * h // tp), ("mlp.linear_fc1.bias", f // tp),
        ("mlp.linear_fc2.weight", h * f // tp), ("mlp.linear_fc2.bias", h),
    ]


@dataclass(frozen=True)
class StageParams:
    """The parameter tensors one (TP rank, PP stage) holds, in ``named_parameters`` order."""

    stage: int
    tensors: Tuple[Tuple[str, int, bool], ...]  # (name, numel, shared_embedding)

    @property
    def numel(self) -> int:
        return sum(n for _, n, _ in self.tensors)


def check_split(shape: ModelShape, tp: int, pp: int) -> None:
    """Raise ``ModelError`` unless TP and PP divide the model the way Megatron requires."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    if h % shape.num_attention_heads:
        raise ModelError("--hidden-size", f"--hidden-size {h} is not divisible by "
                         f"--num-attention-heads {shape.num_attention_heads}")
    if shape.num_attention_heads % tp:
        raise ModelError("--tp", f"--tp {tp} does not divide the {shape.num_attention_heads} "
                         "attention heads")
    if h % tp or f % tp:
        raise ModelError("--tp", f"--tp {tp} does not divide hidden size {h} and FFN size {f}")
    if shape.num_layers % pp:
        raise ModelError("--pp", f"--pp {pp} does not divide the {shape.num_layers} layers")


def stage_params(shape: ModelShape, tp: int, pp: int, stage: int) -> StageParams:
    """Parameters of pipeline stage ``stage`` on one TP rank (Megatron's split).

    The first stage holds the word and position embeddings, the last the final
    LayerNorm and the output layer: its own weight when untied, else (PP > 1) a
    copy of the word embeddings, marked shared (megatron gives it its own bucket).
    """
    check_split(shape, tp, pp)
    h = shape.hidden_size
    vocab = shape.padded_vocab(tp)
    first, last = stage == 0, stage == pp - 1
    tensors: List[Tuple[str, int, bool]] = []
    if first:
        tensors.append(("embedding.word_embeddings.weight", vocab * h // tp, pp > 1
                        and not shape.untied_embeddings))
        tensors.append(("embedding.position_embeddings.weight",
                        shape.max_position_embeddings * h, False))
    per_stage = shape.num_layers // pp
    for layer in range(stage * per_stage, (stage + 1) * per_stage):
        tensors += [(f"decoder.layers.{layer}.{name}", n, False)
                    for name, n in _layer_tensors(shape, tp)]
    if last:
        tensors += [("decoder.final_layernorm.weight", h, False),
                    ("decoder.final_layernorm.bias", h, False)]
        if shape.untied_embeddings:
            tensors.append(("output_layer.weight", vocab * h // tp, False))
        elif pp > 1:
            tensors.append(("output_layer.weight", vocab * h // tp, True))
    return StageParams(stage, tuple(tensors))


def total_params(shape: ModelShape) -> int:
    """Parameters of the whole model (TP = PP = 1), padded vocabulary included."""
    return stage_params(shape, 1, 1, 0).numel


# --- buckets --------------------------------------------------------------------------

def default_bucket_size(dp_size: int) -> int:
    """megatron-core's default DDP bucket (elements) when gradients are reduced overlapped."""
    return max(40_000_000, 1_000_000 * dp_size)


def bucket_numels(params: StageParams, dp_size: int, bucket_size: Optional[int]) -> List[int]:
    """Elements of each DDP bucket (padding included), as megatron-core 0.16 lays them out.

    Mirrors ``_ParamAndGradBuffer.__init__`` with the distributed optimizer:
    parameters in reverse order, each starting at a multiple of 64, a bucket
    closed once it holds ``bucket_size`` elements (None: one bucket) or after a
    shared embedding, every bucket end padded to a multiple of lcm(DP, 128).
    """
    def pad(n: int, divisor: int) -> int:
        return -(-n // divisor) * divisor

    divisor = math.lcm(dp_size, 128)
    bounds: List[int] = []
    bucket_start = start = end = 0
    open_bucket = False
    for _, numel, shared in reversed(params.tensors):
        start = pad(start, 64)
        if shared and open_bucket:
            start = pad(start, divisor)
            bounds.append(start)
            bucket_start = start
        end = start + numel
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            end = pad(end, divisor)
            bounds.append(end)
            bucket_start = start = end
            open_bucket = False
        else:
            start = end
    if open_bucket:
        bounds.append(pad(end, divisor))
    sizes, previous = [], 0
    for bound in bounds:
        sizes.append(bound - previous)
        previous = bound
    return sizes


# --- FLOPs ----------------------------------------------------------------------------

def step_flops(shape: ModelShape, global_batch: int, attention: bool) -> float:
    """Model FLOPs of one training step (forward + backward, no recomputation).

    ``6 * parameters * tokens`` (Kaplan et al.; the output layer is in the
    parameters, tied or not), plus with ``attention`` the score and value
    matmuls, ``12 * layers * seq * hidden`` per token, which together equal
    Megatron-LM's ``num_floating_point_operations`` for this GPT up to the
    LayerNorm, bias and position-embedding terms.
    """
    tokens = global_batch * shape.seq_length
    flops = 6.0 * total_params(shape) * tokens
    if attention:
        flops += 12.0 * shape.num_layers * shape.seq_length * shape.hidden_size * tokens
    return flops


def tp_allreduces(shape: ModelShape, pp: int) -> int:
    """Tensor-parallel all-reduces of seq x micro-batch x hidden activations per micro-batch
    on the busiest pipeline stage (Megatron-LM's row/column-parallel layers, no sequence
    parallelism): two per layer forward (attention output projection, MLP second linear)
    and two backward (the input gradients of the QKV and first MLP linears), plus the
    vocabulary-parallel embedding's forward and the output layer's input gradient
    (one each on the first and the last stage)."""
    return 4 * shape.num_layers // pp + (2 if pp == 1 else 1)
