"""Inside a rank of ``harness.spawn_ranks``: train a tiny megatron-core GPT on CPU.

``TinyGPTTrainer(spec)`` initialises megatron's parallel state (tp = pp = 1, dp =
world size) with the CPU backend enabled, builds a ``GPTModel`` (local layer spec),
wraps it in megatron's ``DistributedDataParallel`` and builds
``get_megatron_optimizer`` (Adam; distributed optimizer by default).
``train_steps(n)`` runs megatron's own ``forward_backward`` schedule on synthetic,
deterministic token batches (each rank its own) and ``optimizer.step()``, and
returns per step the rank's loss and a SHA-256 of the model weights.

``refusal(config, spec)``: the one-line error with which installing the layer and
building a trainer is refused, if it is.

``reference_train(spec, world_size, steps)`` trains the same model (same init) in
one process with plain autograd and ``torch.optim.AdamW`` on the concatenation of all
ranks' batches; ``assemble_reduced_grads`` rebuilds full gradients from the
reduce-scattered shards the ranks return, for comparison with the reference.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_sdp4bit.megatron.consistency import weights_sha256

__all__ = [
    "TinyGPTSpec",
    "StepRecord",
    "TinyGPTTrainer",
    "synthetic_batch",
    "reference_train",
    "assemble_reduced_grads",
    "refusal",
    "weights_sha256",
]


# --------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class TinyGPTSpec:
    """What to build and how to train it. Defaults: a 2-layer, 64-wide GPT in fp32."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 32
    micro_batch_size: int = 2
    num_microbatches: int = 1
    dtype: str = "fp32"
    """``"fp32"`` or ``"bf16"`` (bf16 params, megatron's ``Float16Module``)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute_activations: bool = False
    """Full activation recomputation of every layer (replays the RNG states in backward)."""
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None
    """Params per bucket (needs ``overlap_grad_reduce``; megatron uses one bucket without)."""
    grad_reduce_in_fp32: bool = False
    lr: float = 3e-3
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 1234
    """Model init and dropout seed (megatron's ``model_parallel_cuda_manual_seed``)."""
    data_seed: int = 0

    def __post_init__(self):
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length", "micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_attention_heads ({self.num_attention_heads})")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.overlap_param_gather and not (self.use_distributed_optimizer
                                              and self.overlap_grad_reduce):
            raise ValueError("overlap_param_gather needs use_distributed_optimizer=True and "
                             "overlap_grad_reduce=True (as in megatron's argument checks)")
        if self.bucket_size is not None and not self.overlap_grad_reduce:
            raise ValueError("bucket_size has no effect without overlap_grad_reduce=True "
                             "(megatron then uses a single bucket); set both or neither")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1 or None, got {self.bucket_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32


@dataclasses.dataclass
class StepRecord:
    """One training step as one rank saw it."""

    loss: float
    """This rank's mean token loss over its microbatches (before the update)."""
    weights_sha256: str
    """SHA-256 of the model weights after the step's update (rank-independent if synced)."""
    reduced_grad_shards: Optional[List[Tuple[int, int, torch.Tensor]]] = None
    """If captured: ``(buffer index, start in buffer, fp32 values)`` of the gradient shard
    this rank holds after the reduce-scatter (see ``assemble_reduced_grads``)."""


def synthetic_batch(spec: TinyGPTSpec, step: int, dp_rank: int,
                    microbatch: int) -> Dict[str, torch.Tensor]:
    """A deterministic, learnable batch: each row follows ``x' = (5x + 3) mod vocab``.

    Only the start tokens are random, drawn from a generator seeded by
    ``(data_seed, step, dp_rank, microbatch)``, so every rank has its own data and a
    reference can rebuild any rank's batch.
    """
    gen = torch.Generator().manual_seed(
        ((spec.data_seed * 1000003 + step) * 1009 + dp_rank) * 101 + microbatch)
    tokens = torch.empty(spec.micro_batch_size, spec.seq_length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(spec.vocab_size, (spec.micro_batch_size,), generator=gen)
    for t in range(spec.seq_length):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % spec.vocab_size
    position_ids = torch.arange(spec.seq_length).unsqueeze(0).expand(spec.micro_batch_size, -1)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": position_ids.contiguous()}


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _seed_and_build_gpt(spec: TinyGPTSpec):
    """``GPTModel`` from ``spec``, initialised from ``spec.seed`` exactly as megatron does."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(spec.seed)
    model_parallel_cuda_manual_seed(spec.seed)
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        hidden_dropout=spec.hidden_dropout,
        attention_dropout=spec.attention_dropout,
        bf16=spec.dtype == "bf16",
        params_dtype=spec.params_dtype,
        use_cpu_initialization=False,  # megatron's GPU init path: the RNG tracker's fork
        **(dict(recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=1) if spec.recompute_activations else {}),
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        share_embeddings_and_output_weights=True,
    )
    return model, config


def _loss_of(output: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Mean token loss from GPTModel's per-token losses (megatron's 2-tuple convention)."""
    loss = output.float().mean()
    # A copy: the schedule divides the returned loss in place by num_microbatches.
    return loss, {"lm loss": loss.detach().clone()}


class TinyGPTTrainer:
    """A tiny GPT trained by megatron-core's DDP, optimizer and schedule, inside one rank.

    Requires an initialised gloo process group (``spawn_ranks`` does that). The first
    trainer of a process enables the CPU backend, initialises megatron's parallel state
    (tp = pp = 1, dp = world size) and checks the gloo collectives; later trainers reuse
    it, so several specs can be trained one after another in one world.
    """

    def __init__(self, spec: TinyGPTSpec):
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        from megatron_sdp4bit.cpu_backend import enable_cpu_backend
        from megatron_sdp4bit.diagnostics.gloo_collectives import check_gloo_collectives

        if not torch.distributed.is_initialized():
            raise RuntimeError("TinyGPTTrainer needs torch.distributed initialised with gloo "
                               "(run it under harness.spawn_ranks)")
        enable_cpu_backend()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                     pipeline_model_parallel_size=1)
            check_gloo_collectives(parallel_state.get_data_parallel_group())
        self.spec = spec
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.steps_done = 0

        model, config = _seed_and_build_gpt(spec)
        if spec.dtype == "bf16":
            model = Float16Module(config, model)
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=spec.grad_reduce_in_fp32,
            overlap_grad_reduce=spec.overlap_grad_reduce,
            overlap_param_gather=spec.overlap_param_gather,
            use_distributed_optimizer=spec.use_distributed_optimizer,
            bucket_size=spec.bucket_size,
        )
        self.model = DistributedDataParallel(config=config, ddp_config=self.ddp_config,
                                             module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=spec.lr, weight_decay=spec.weight_decay,
                adam_beta1=spec.adam_beta1, adam_beta2=spec.adam_beta2, adam_eps=spec.adam_eps,
                clip_grad=spec.clip_grad, bf16=spec.dtype == "bf16",
                params_dtype=spec.params_dtype,
                use_distributed_optimizer=spec.use_distributed_optimizer),
            [self.model])
        # What megatron's training loop wires into the config before training.
        config.no_sync_func = self.model.no_sync
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        self.config = config
        # With overlap_param_gather the all-gather of step k's update is finished by the
        # forward pre-hooks of step k + 1; weights are hashed once that forward is done.
        self._pending: List[StepRecord] = []
        self.model.register_forward_hook(self._hash_pending_after_forward)

    # ---------------------------------------------------------------- introspection

    @property
    def num_buckets(self) -> int:
        """Bucket groups of the DDP model (several when ``bucket_size`` is small)."""
        return len(self.model.bucket_groups)

    def named_weights(self) -> Dict[str, torch.Tensor]:
        """fp32 copies of the model weights, by name without DDP/Float16Module prefixes."""
        return {_strip_wrappers(n): p.detach().float().clone()
                for n, p in self.model.named_parameters()}

    def grad_layout(self) -> Dict[str, Tuple[int, int, int, Tuple[int, ...]]]:
        """Where each param's gradient lives: ``name -> (buffer, start, end, shape)``."""
        layout = {}
        names = {p: _strip_wrappers(n) for n, p in self.model.named_parameters()}
        for index, buffer in enumerate(self.model.buffers):
            for param, (start, end, _bucket) in buffer.param_index_map.items():
                layout[names[param]] = (index, start, end, tuple(param.shape))
        return layout

    def _reduced_grad_shards(self) -> List[Tuple[int, int, torch.Tensor]]:
        shards = []
        for index, buffer in enumerate(self.model.buffers):
            for bucket in buffer.buckets:
                size = bucket.grad_data.numel() // self.dp_size
                local = bucket.grad_data[self.dp_rank * size:(self.dp_rank + 1) * size]
                shards.append((index, bucket.offset + self.dp_rank * size,
                               local.detach().float().clone()))
        return shards

    # ---------------------------------------------------------------------- training

    def _microbatches(self, step: int) -> Iterator[Dict[str, torch.Tensor]]:
        for mb in range(self.spec.num_microbatches):
            yield synthetic_batch(self.spec, step, self.dp_rank, mb)

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, _loss_of

    def _hash_pending_after_forward(self, module, inputs, output) -> None:
        if self._pending:
            digest = weights_sha256(self.model)
            for record in self._pending:
                record.weights_sha256 = digest
            self._pending.clear()

    def train_steps(self, n: int, capture_reduced_grads: bool = False) -> List[StepRecord]:
        """Run ``n`` training steps; return each step's loss and post-update weight hash."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        forward_backward = get_forward_backward_func()
        records = []
        for _ in range(n):
            step = self.steps_done
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=self._forward_step,
                data_iterator=self._microbatches(step),
                model=[self.model],
                num_microbatches=self.spec.num_microbatches,
                seq_length=self.spec.seq_length,
                micro_batch_size=self.spec.micro_batch_size,
                forward_only=False,
            )
            shards = self._reduced_grad_shards() if capture_reduced_grads else None
            ok, _grad_norm, _zeros = self.optimizer.step()
            if not ok:
                raise RuntimeError(f"optimizer step {step} was skipped (inf/nan gradients)")
            loss = sum(float(d["lm loss"]) for d in losses) / len(losses)
            record = StepRecord(loss=loss, weights_sha256="", reduced_grad_shards=shards)
            if self.ddp_config.overlap_param_gather:
                self._pending.append(record)  # hashed by the next forward
            else:
                record.weights_sha256 = weights_sha256(self.model)
            records.append(record)
            self.steps_done += 1
        if self._pending:
            # No next forward in this call: finish the param all-gather now, as megatron
            # does before evaluation or checkpointing.
            self.model.start_param_sync(force_sync=True)
            self._hash_pending_after_forward(None, None, None)
        return records


def refusal(config, spec: Optional[TinyGPTSpec] = None) -> Optional[str]:
    """The message of the ``RuntimeError`` with which installing the patch layer with
    ``config`` (and, with ``spec``, building that trainer) is refused; None when nothing
    is. The layer is uninstalled after, either way."""
    from megatron_sdp4bit.megatron import patch

    try:
        patch.install(config)
        if spec is not None:
            TinyGPTTrainer(spec)
    except RuntimeError as error:
        return str(error)
    finally:
        patch.uninstall()
    return None


# ------------------------------------------------------------------------ the reference


def reference_train(spec: TinyGPTSpec, world_size: int,
                    steps: int) -> Tuple[List[float], List[Dict[str, torch.Tensor]],
                                         Dict[str, torch.Tensor]]:
    """Train ``spec``'s model in this process on all ranks' batches at once.

    Plain autograd on the unwrapped ``GPTModel`` (same seed, same init), the global
    mean token loss over the concatenated batch, megatron's clipping rule (scale by
    ``clip / (norm + 1e-6)`` when below 1) and ``torch.optim.AdamW``. Needs megatron's
    parallel state (any rank of a ``TinyGPTTrainer`` world); only fp32 without
    dropout, so it is a deterministic function of the data.

    Returns per-step losses, per-step gradients (by name) and the final weights.
    """
    if spec.dtype != "fp32" or spec.hidden_dropout or spec.attention_dropout:
        raise ValueError("reference_train supports fp32 without dropout only")
    if spec.weight_decay:
        raise ValueError("reference_train supports weight_decay=0 only (megatron exempts "
                         "biases and norms from decay, which this reference does not model)")
    model, _config = _seed_and_build_gpt(spec)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=spec.lr, weight_decay=0.0,
                                  betas=(spec.adam_beta1, spec.adam_beta2), eps=spec.adam_eps)
    losses, grads = [], []
    for step in range(steps):
        batches = [synthetic_batch(spec, step, rank, mb)
                   for rank in range(world_size) for mb in range(spec.num_microbatches)]
        batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        optimizer.zero_grad(set_to_none=True)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = output.float().mean()
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in params.items()})
        if spec.clip_grad > 0:
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params.values()))
            coeff = spec.clip_grad / (float(norm) + 1e-6)
            if coeff < 1.0:
                for p in params.values():
                    p.grad.mul_(coeff)
        optimizer.step()
        losses.append(loss.detach().item())
    return losses, grads, {n: p.detach().clone() for n, p in params.items()}


def assemble_reduced_grads(per_rank_shards: Sequence[List[Tuple[int, int, torch.Tensor]]],
                           layout: Dict[str, Tuple[int, int, int, Tuple[int, ...]]]
                           ) -> Dict[str, torch.Tensor]:
    """Full gradients by name from every rank's reduce-scattered shards.

    ``per_rank_shards[r]`` is rank r's ``StepRecord.reduced_grad_shards``; ``layout`` is
    ``TinyGPTTrainer.grad_layout()``. Every gradient element must be covered by exactly
    one rank's shard (else ``ValueError``), which is what the reduce-scatter promises.
    """
    sizes: Dict[int, int] = {}
    for shards in per_rank_shards:
        for index, start, values in shards:
            sizes[index] = max(sizes.get(index, 0), start + values.numel())
    full = {index: torch.full((size,), float("nan")) for index, size in sizes.items()}
    owners = {index: torch.zeros(size, dtype=torch.int32) for index, size in sizes.items()}
    for shards in per_rank_shards:
        for index, start, values in shards:
            full[index][start:start + values.numel()] = values
            owners[index][start:start + values.numel()] += 1
    grads = {}
    for name, (index, start, end, shape) in layout.items():
        if not torch.all(owners[index][start:end] == 1):
            raise ValueError(f"gradient of {name} is not covered exactly once by the shards")
        grads[name] = full[index][start:end].view(shape).clone()
    return grads
