"""GPT model, DDP wrapper, distributed optimizer and LR schedule from megatron-core parts.

Everything here is megatron-core's own: ``GPTModel`` with the Transformer Engine
layer spec when TE imports on a GPU (the local spec otherwise), fused kernels
where they import (``fusions.py``), megatron's
``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam with decoupled
weight decay, sharded when ``--use-distributed-optimizer``), and
``OptimizerParamScheduler`` for warm-up + cosine/linear decay to ``--min-lr``.
"""
from __future__ import annotations

import torch

from megatron_sdp4bit.training.fusions import Fusions, module_imports


def _layer_spec(impl: str, device: str):
    """megatron-core's Transformer Engine layer spec when TE imports (and the run is
    on CUDA), its local spec otherwise; ``impl`` is ``--transformer-impl``."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if impl == "local":
        return specs.get_gpt_layer_local_spec(), "local"
    if device != "cuda":
        if impl == "transformer_engine":
            raise RuntimeError("--transformer-impl transformer_engine needs a GPU; "
                               "use --transformer-impl local (or auto) on the CPU")
        return specs.get_gpt_layer_local_spec(), "local"
    if module_imports("transformer_engine"):
        return specs.get_gpt_layer_with_transformer_engine_spec(), "transformer_engine"
    if impl == "transformer_engine":
        raise RuntimeError("--transformer-impl transformer_engine: Transformer Engine does not "
                           "import here; install it or use --transformer-impl local")
    return specs.get_gpt_layer_local_spec(), "local"


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 (times TP size)."""
    return -(-vocab_size // multiple) * multiple


def transformer_config(args, device: str, fusions: Fusions):
    """megatron-core's TransformerConfig for the driver's flags, on ``device``."""
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=device != "cuda",
        **fusions.as_config_kwargs(),
    )


def build_gpt(args, vocab_size: int, device: str, fusions: Fusions):
    """The bare GPTModel (no DDP, no bf16 wrapper) on ``device``, and its config."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(args, device, fusions)
    spec, impl = _layer_spec(args.transformer_impl, device)
    args.transformer_impl_used = impl
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size),
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
    )
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    return model, config


def build_model(args, vocab_size: int, device: str, fusions: Fusions):
    """The DDP-wrapped GPTModel on ``device`` (``"cuda"`` or ``"cpu"``) and its config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model, config = build_gpt(args, vocab_size, device, fusions)
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.bucket_size,
        average_in_collective=False,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    # Megatron-LM broadcasts params from DP rank 0 at start-up; the seeds already
    # make them equal, and this makes it so regardless of initialization order.
    ddp.broadcast_params()
    return ddp, config


def build_optimizer(args, ddp):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # A constant loss scale of 1 changes no value, but it makes megatron's mixed-
        # precision and distributed optimizers check the gradients for Inf/NaN every
        # step (all-reduced over the gradient-statistics group, data-parallel ranks
        # included) and skip the step, as they do for fp16.
        loss_scale=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    # As in Megatron-LM, the schedule counts samples: the driver steps it by the
    # global batch size, so iterations are converted here.
    samples = args.global_batch_size
    warmup = args.lr_warmup_iters or int(args.lr_warmup_fraction * args.lr_decay_iters)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup * samples,
        lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
