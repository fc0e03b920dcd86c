"""GPT model, DDP wrapper, distributed optimizer and LR schedule from megatron-core parts.

Everything here is megatron-core's own: ``GPTModel`` with the Transformer Engine
layer spec when TE is installed (the local spec otherwise), megatron's
``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam with decoupled
weight decay, sharded when ``--use-distributed-optimizer``), and
``OptimizerParamScheduler`` for warm-up + cosine/linear decay to ``--min-lr``.
"""
from __future__ import annotations

import torch


def _layer_spec(impl: str):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if impl in ("auto", "transformer_engine"):
        try:
            import transformer_engine  # noqa: F401

            return specs.get_gpt_layer_with_transformer_engine_spec(), "transformer_engine"
        except ImportError:
            if impl == "transformer_engine":
                raise RuntimeError(
                    "--transformer-impl transformer_engine: Transformer Engine is not installed; "
                    "install it or use --transformer-impl local"
                ) from None
    return specs.get_gpt_layer_local_spec(), "local"


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 (times TP size)."""
    return -(-vocab_size // multiple) * multiple


def build_model(args, vocab_size: int, use_cpu: bool):
    """The DDP-wrapped GPTModel and its TransformerConfig."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
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
        use_cpu_initialization=use_cpu,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=not use_cpu,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    spec, impl = _layer_spec(args.transformer_impl)
    args.transformer_impl_used = impl
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size),
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
    )
    if not use_cpu:
        model.cuda(torch.cuda.current_device())
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
