"""GPT model, DDP wrapper, distributed optimizer and LR schedule from megatron-core parts.

Everything here is megatron-core's own: ``GPTModel`` with the Transformer Engine
layer spec when TE imports on a GPU (the local spec otherwise), fused kernels
where they import (``fusions.py``), megatron's
``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam with decoupled
weight decay, sharded when ``--use-distributed-optimizer``), and
``OptimizerParamScheduler`` for warm-up + cosine/linear decay to ``--min-lr``.

Tensor and pipeline parallelism are built as Megatron-LM's ``get_model`` builds
them: one ``GPTModel`` per virtual pipeline stage on this rank (``pre_process`` on
the very first chunk of the pipeline, ``post_process`` on the very last, each with
its ``vp_stage``), each wrapped in its own DDP (bucketing only for the first).
"""
from __future__ import annotations

import contextlib
import logging

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from megatron_sdp4bit.training.arguments import ArgumentError
from megatron_sdp4bit.training.distributed import virtual_pipeline_size
from megatron_sdp4bit.training.fusions import Fusions, module_imports
from megatron_sdp4bit.training.vocab import padded_vocab_size


def _layer_spec(impl: str, device: str, num_experts=None):
    """megatron-core's Transformer Engine layer spec when TE imports (and the run is
    on CUDA), its local spec otherwise; ``impl`` is ``--transformer-impl``. With
    ``num_experts`` the MLPs are megatron's MoE layers (one expert MLP each, no
    grouped GEMM: it needs Transformer Engine or a GPU kernel)."""
    moe = dict(num_experts=num_experts, moe_grouped_gemm=False)
    local = specs.get_gpt_layer_local_spec(**moe), "local"
    if impl == "local":
        return local
    if device != "cuda":
        if impl == "transformer_engine":
            raise ArgumentError("--transformer-impl transformer_engine needs a GPU; "
                               "use --transformer-impl local (or auto) on the CPU")
        return local
    if module_imports("transformer_engine"):
        return specs.get_gpt_layer_with_transformer_engine_spec(**moe), "transformer_engine"
    if impl == "transformer_engine":
        raise ArgumentError("--transformer-impl transformer_engine: Transformer Engine does not "
                           "import here; install it or use --transformer-impl local")
    return local


def _parallel_config_kwargs(args) -> dict:
    """TP/PP/VP sizes for megatron's config, with Megatron-LM's p2p defaults: the
    interleaved schedule overlaps its sends with compute, the plain one batches them."""
    virtual = virtual_pipeline_size(args)
    return dict(tensor_model_parallel_size=args.tensor_model_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=virtual,
                overlap_p2p_comm=virtual is not None, batch_p2p_comm=virtual is None)


def _same_named(args, *names: str) -> dict:
    """``{name: args.name}``: the flags megatron's configs take under their own name
    (as Megatron-LM builds its configs from its arguments)."""
    return {name: getattr(args, name) for name in names}


def transformer_config(args, device: str, fusions: Fusions):
    """megatron-core's TransformerConfig for the driver's flags, on ``device``."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        **_same_named(args, "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                      "hidden_dropout", "attention_dropout", "init_method_std", "bf16"),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=device != "cuda",
        **_parallel_config_kwargs(args),
        **_experts_config_kwargs(args),
        **fusions.as_config_kwargs(),
    )


# What megatron-core 0.16-0.18's MoE helpers import from Transformer Engine, in one try
# block, leaving the names unbound when TE is missing (0.19 binds them to None).
_MOE_TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
                 "fused_unpermute", "te_general_gemm")


def _bind_missing_moe_te_names() -> None:
    """Without Transformer Engine, megatron-core 0.16-0.18's router gating tests
    ``te_general_gemm is not None`` on a name its module never bound: every MoE step
    failed with a NameError (the CPU, and GPUs without TE). Bind the missing names to
    None, as megatron-core 0.19 does; nothing changes where TE imported."""
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", True):
        return
    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _experts_config_kwargs(args) -> dict:
    """The MoE layer's settings (none for a dense model): top-k routing over
    ``--num-experts`` experts of ``--ffn-hidden-size``, split over the expert-parallel
    ranks, tokens exchanged by megatron's all-gather dispatcher, no linear biases (as
    Megatron-LM's MoE recipes, ``--disable-bias-linear``: megatron-core's expert MLP
    adds its bias in place into a view of its output, which autograd refuses at EP 1),
    and Megatron-LM's defaults otherwise (no auxiliary load-balancing loss)."""
    if args.num_experts is None:
        return {}
    _bind_missing_moe_te_names()
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                expert_model_parallel_size=args.expert_model_parallel_size,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, add_bias_linear=False)


class _DropDeprecationNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "IS DEPRECATED" not in record.getMessage()


@contextlib.contextmanager
def _quiet_gpt_deprecation():
    """megatron-core 0.19 logs "GPTModel IS DEPRECATED ..." at every build: advice to
    whoever writes model code, about a class the driver chooses, so on a user's
    stderr it is noise (and it broke the one-line error reports). Other records of
    that logger pass."""
    logger = logging.getLogger(GPTModel.__module__)
    notice = _DropDeprecationNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def build_gpt(args, vocab_size: int, device: str, fusions: Fusions, config=None,
              pre_process: bool = True, post_process: bool = True, vp_stage=None):
    """One bare GPTModel chunk (no DDP, no bf16 wrapper) on ``device``, and its config.

    ``pre_process``: this chunk holds the embeddings (first pipeline stage);
    ``post_process``: the output layer and loss (last stage); ``vp_stage``: which
    virtual pipeline stage it is (None without interleaving). The defaults are the
    whole model. The vocabulary is padded to a multiple of 128 x TP, as in Megatron-LM.
    """
    config = config or transformer_config(args, device, fusions)
    spec, impl = _layer_spec(args.transformer_impl, device, args.num_experts)
    args.transformer_impl_used = impl
    with _quiet_gpt_deprecation():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(vocab_size, args.tensor_model_parallel_size),
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type="learned_absolute",
            vp_stage=vp_stage,
        )
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    elif args.num_experts is not None:
        _draw_experts_per_expert_rank(model, config, args.seed)
    return model, config


def _draw_experts_per_expert_rank(model, config, seed: int) -> None:
    """On CPU megatron initialises every weight from torch's default generator, seeded
    alike on every rank: the experts of expert-parallel rank 1 began as copies of rank
    0's. Draw the expert weights again, as megatron does on GPUs, from a stream seeded
    like its expert RNG tracker (seed + 100 x pipeline rank + 1024 + 100 x
    expert-parallel rank), each with the init method megatron gave it (the second
    linear layer: the output layers' scaled one), in fp32 and then cast, as megatron's
    CPU initialisation does."""
    expert_seed = (seed + 100 * parallel_state.get_pipeline_model_parallel_rank() + 1024
                   + 100 * parallel_state.get_expert_model_parallel_rank())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(expert_seed)
        for name, module in model.named_modules():
            if not getattr(module, "is_expert", False) or getattr(module, "weight", None) is None:
                continue
            init = config.output_layer_init_method if "linear_fc2" in name else config.init_method
            weight = torch.empty(module.weight.shape, dtype=torch.float32)
            init(weight)
            with torch.no_grad():
                module.weight.copy_(weight)


def build_gpt_chunks(args, vocab_size: int, device: str, fusions: Fusions):
    """This rank's model chunks (one per virtual pipeline stage, else one) and their config,
    as Megatron-LM's ``get_model`` calls ``model_provider``."""
    config = transformer_config(args, device, fusions)
    virtual = virtual_pipeline_size(args)
    stages = range(virtual) if virtual else [None]
    chunks = []
    for vp_stage in stages:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=virtual is None, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=virtual is None, vp_stage=vp_stage)
        chunk, _ = build_gpt(args, vocab_size, device, fusions, config=config,
                             pre_process=pre, post_process=post, vp_stage=vp_stage)
        chunk.vp_stage = vp_stage
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunks.append(chunk)
    return chunks, config


def build_model(args, vocab_size: int, device: str, fusions: Fusions):
    """This rank's model chunks on ``device`` (``"cuda"`` or ``"cpu"``), each wrapped in
    megatron's DDP (a list of one without virtual pipeline stages), and their config."""
    chunks, config = build_gpt_chunks(args, vocab_size, device, fusions)
    if args.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        average_in_collective=False,
        **_same_named(args, "overlap_grad_reduce", "overlap_param_gather",
                      "use_distributed_optimizer", "bucket_size"),
    )
    # As Megatron-LM: buckets for the first chunk only; the later chunks' communication
    # overlaps with the other chunks' compute anyway.
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    # Megatron-LM broadcasts params from DP rank 0 at start-up; the seeds already
    # make them equal, and this makes it so regardless of initialization order.
    for chunk in model:
        chunk.broadcast_params()
    return model, config


class ModelChunks(torch.nn.ModuleList):
    """This rank's DDP chunks (virtual pipeline stages) as one module, for what sees the
    whole rank's model: checkpoints and weight hashes. Its state dict is Megatron-LM's
    for virtual stages, ``{"model0": chunk 0's, "model1": ...}``, each the chunk's own
    (megatron's DDP and Float16Module leave their wrappers out of the keys)."""

    def state_dict(self, *args, **kwargs):
        return {f"model{index}": chunk.state_dict(*args, **kwargs) for index, chunk in enumerate(self)}

    def load_state_dict(self, state_dict, strict: bool = True):
        for index, chunk in enumerate(self):
            chunk.load_state_dict(state_dict[f"model{index}"], strict=strict)


def model_chunks(model) -> list:
    """The DDP chunks of ``model``: a list of them, a ModuleList, or one chunk."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def optimizer_checks_nonfinite(args) -> bool:
    """Whether megatron's optimizer for these flags finds Inf/NaN gradients and skips
    the step itself: its mixed-precision and distributed optimizers do (given the
    loss scale ``build_optimizer`` sets); its plain fp32 optimizer does not."""
    return bool(args.bf16 or args.use_distributed_optimizer)


def build_optimizer(args, model):
    opt_config = OptimizerConfig(
        optimizer="adam",
        **_same_named(args, "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                      "clip_grad", "bf16", "use_distributed_optimizer"),
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        # A constant loss scale of 1 changes no value, but it makes megatron's mixed-
        # precision and distributed optimizers check the gradients for Inf/NaN every
        # step (all-reduced over the gradient-statistics group, data-parallel ranks
        # included) and skip the step, as they do for fp16.
        loss_scale=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, model_chunks(model))
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
        # Which values a resume takes where this run's and the checkpoint's differ
        # (checkpoint/overrides.py refuses a difference when neither is set).
        **_same_named(args, "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"),
    )
    return optimizer, scheduler
