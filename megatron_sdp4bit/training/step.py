"""One training step and one evaluation, with megatron-core's own schedule.

``forward_step`` is what megatron's ``get_forward_backward_func()`` calls per
micro-batch (Megatron-LM's contract: the output and a loss function);
``train_step`` is one iteration (gradients zeroed, forward/backward over the
micro-batches, optimizer step, LR schedule); ``evaluate`` is the validation loss.
Tensor, pipeline and virtual-pipeline parallelism use megatron's own schedules
(1F1B, interleaved with virtual stages); the model is then a list of chunks.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_sdp4bit.data.batches import batch_to_device
from megatron_sdp4bit.training.datasets import data_iterators
from megatron_sdp4bit.training.distributed import all_reduce_mean, is_loss_rank
from megatron_sdp4bit.training.model import model_chunks, optimizer_checks_nonfinite


def gradients_poisoned_unless_finite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` itself when finite; otherwise the same value with NaN gradients.

    An Inf loss can still have finite gradients (cross-entropy of a token whose
    probability underflowed to 0), so the optimizer's Inf/NaN check on the
    gradients alone would let that step through. Multiplying by 1 changes no bit
    of a finite loss or of its gradients; multiplying by NaN makes every gradient
    of this micro-batch NaN, which megatron's all-reduced check then sees on every
    rank. On the device, no host synchronisation.
    """
    finite = torch.isfinite(loss.detach())
    return loss * torch.where(finite, 1.0, math.nan).to(loss.dtype)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def forward_step(data_iterator, model):
    """One micro-batch through the model, as megatron's schedule calls it.

    The data loader yields CPU tensors; they go to the model's device here (an
    asynchronous copy from pinned memory on a GPU).
    """
    batch = batch_to_device(next(data_iterator), model_device(model))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_mask = batch["loss_mask"].float()

    def loss_func(output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        loss = gradients_poisoned_unless_finite(loss)
        # clone: megatron's schedule divides the returned loss in place by the number
        # of micro-batches, which a plain detach() would share.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def run_schedule(ddp, args, data_iterator, num_microbatches: int, forward_only: bool,
                 forward_step_func: Callable = forward_step) -> torch.Tensor:
    """The mean loss over the micro-batches, as a tensor on the model's device: reading
    it (a host-device synchronisation) waits for the logging interval. Pipeline stages
    other than the last have no loss: zero there (``is_loss_rank`` says which count)."""
    chunks = model_chunks(ddp)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=chunks,
        num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only,
    )
    if not losses:
        return torch.zeros((), dtype=torch.float32, device=model_device(chunks[0]))
    return torch.stack([d["lm loss"].float() for d in losses]).mean()


def wire_schedule_hooks(ddp, optimizer) -> None:
    """What megatron's schedule calls back into, as Megatron-LM's training loop sets it:
    without ``finalize_model_grads_func`` the gradients would never be reduced. ``ddp``
    is one DDP chunk or several (virtual pipeline stages): one callback per chunk."""
    chunks = model_chunks(ddp)
    config = chunks[0].config  # one TransformerConfig for all chunks

    def per_chunk(name):
        functions = [getattr(chunk, name) for chunk in chunks]
        return functions[0] if len(functions) == 1 else functions

    config.no_sync_func = per_chunk("no_sync")
    if chunks[0].ddp_config.overlap_grad_reduce:
        # Megatron-LM's default (--align-grad-reduce): with pipeline stages, each chunk's
        # reduce-scatter starts when the schedule has run its last backward (the schedule
        # without pipelining does not use it).
        config.grad_sync_func = per_chunk("start_grad_sync")
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads


def optimizer_step(optimizer, checks_nonfinite: bool) -> tuple:
    """(whether the optimizer stepped, gradient norm); a step whose gradients hold
    Inf/NaN is skipped on every rank alike.

    ``checks_nonfinite``: whether megatron's optimizer skips such a step itself (its
    check is all-reduced). Its plain fp32 optimizer does not: it would apply the
    step. There the gradient norm is taken first (the same value on every rank: the
    gradients are all-reduced, the norm over model-parallel ranks too) and a
    non-finite one skips the step. That costs one extra pass over the gradients,
    on that path only. ``prepare_grads`` is idempotent there (it points ``.grad``
    at ``main_grad``), so ``step`` may run it again.
    """
    if not checks_nonfinite:
        optimizer.prepare_grads()
        grad_norm = optimizer.get_grad_norm()
        if not math.isfinite(grad_norm):
            return False, grad_norm
    ok, grad_norm, _ = optimizer.step()
    return ok, grad_norm


def train_step(ddp, optimizer, scheduler, args, data_iterator, num_microbatches: int,
               forward_step_func: Callable = forward_step) -> tuple:
    """One iteration; returns (loss tensor, grad norm, whether the optimizer stepped).

    megatron's optimizer skips a step whose gradients hold Inf/NaN (on every rank
    alike: the check is all-reduced); the schedule then does not advance either.
    """
    for chunk in model_chunks(ddp):
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = run_schedule(ddp, args, data_iterator, num_microbatches, forward_only=False,
                        forward_step_func=forward_step_func)
    ok, grad_norm = optimizer_step(optimizer, optimizer_checks_nonfinite(args))
    if ok:
        scheduler.step(increment=args.global_batch_size)
    return loss, grad_norm, ok


def evaluate(ddp, args, valid, layout, num_microbatches: int,
             forward_step_func: Callable = forward_step,
             stop: Optional[Callable[[], object]] = None) -> Optional[float]:
    """The validation loss over ``--eval-iters`` batches (at least one: with 0 the
    policy never evaluates), the same batches every time, averaged over the
    data-parallel replicas (the last pipeline stage has it). ``stop``, a collective
    asked before every batch: when it answers, the evaluation ends there and returns
    None."""
    ddp.eval()
    iterator = data_iterators(valid, args, layout, 0)
    losses = []
    try:
        with torch.no_grad():
            for _ in range(args.eval_iters):
                if stop is not None and stop():
                    return None
                losses.append(run_schedule(ddp, args, iterator, num_microbatches, forward_only=True,
                                           forward_step_func=forward_step_func))
    finally:
        ddp.train()
    return all_reduce_mean(torch.stack(losses).mean(), weight=float(is_loss_rank()))
