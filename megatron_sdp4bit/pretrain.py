"""GPT pre-training on megatron-core, with SDP4Bit communication.

    torchrun --nproc-per-node 4 -m megatron_sdp4bit.pretrain --sdp4bit --bf16 \
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 ...

Megatron-LM's flag names and meanings (see ``training/arguments.py``). The
model, DDP, distributed optimizer, schedule and datasets are megatron-core's own
parts (``training/model.py``, ``data/``); this file only runs the loop:
forward/backward with megatron's schedule, optimizer step, LR schedule, logging,
evaluation and checkpoints. Without a GPU it runs on gloo with the CPU backend.

Tensor, pipeline and virtual-pipeline parallelism (``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size``, ``--num-layers-per-virtual-pipeline-stage``) use
megatron's own schedules (``get_forward_backward_func``: 1F1B, interleaved with
virtual stages); the model is then a list of chunks, one DDP each. SDP4Bit
quantizes the data-parallel collectives of every chunk, as in the paper.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Optional

import torch

from megatron_sdp4bit.config import preset
from megatron_sdp4bit.flag_errors import report_bad_flag
from megatron_sdp4bit.training.arguments import ArgumentError, parse_args


def _log0(*args) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(*args, flush=True)


# --- data ------------------------------------------------------------------------------

def build_data(args, dp_rank: int, dp_size: int):
    """Tokenizer and train/valid datasets (the embedded corpus when no --data-path)."""
    from megatron_sdp4bit.data import (build_gpt_datasets, build_tokenizer,
                                       load_default_corpus_tokenizer, prepare_default_corpus)

    if args.data_path:
        from megatron_sdp4bit.data.gpt_datasets import check_data_path

        check_data_path(args.data_path)  # before the tokenizer: fail fast on bad files
        if args.tokenizer_type is None:
            raise ArgumentError("--data-path needs --tokenizer-type: the tokenizer the data was "
                                "preprocessed with (GPT2BPETokenizer, HuggingFaceTokenizer or "
                                "StdlibBPETokenizer)")
        tokenizer = build_tokenizer(args.tokenizer_type,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    tokenizer_model=args.tokenizer_model)
        data_path = args.data_path
    else:
        if args.tokenizer_type not in (None, "StdlibBPETokenizer"):
            raise ArgumentError("--tokenizer-type needs --data-path (the embedded corpus has its own tokenizer)")
        prefix = prepare_default_corpus(max_mb=args.default_corpus_mb)
        tokenizer = load_default_corpus_tokenizer(prefix)
        data_path = [prefix]
        _log0(f"data: embedded corpus (Python standard library) at {prefix}")
    evals = args.train_iters // args.eval_interval + 1
    train, valid, _test = build_gpt_datasets(
        data_path, tokenizer, args.seq_length,
        train_samples=args.train_iters * args.global_batch_size,
        valid_samples=evals * args.eval_iters * args.global_batch_size,
        test_samples=args.eval_iters * args.global_batch_size,
        split=args.split, seed=args.seed, path_to_cache=args.data_cache_path,
    )
    return tokenizer, train, valid


def _micro_batches(dataset, args, dp_rank, dp_size, consumed_samples):
    from megatron_sdp4bit.data import iterate_micro_batches

    return iterate_micro_batches(dataset, args.micro_batch_size, dp_rank, dp_size, consumed_samples,
                                 pin_memory=torch.cuda.is_available())


def _data_iterators(dataset, args, layout, consumed_samples):
    """This data-parallel rank's micro-batches: one iterator, or one per model chunk for
    the interleaved schedule (each chunk reads every micro-batch, as in Megatron-LM)."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    iterators = [_micro_batches(dataset, args, dp_rank, layout.data, consumed_samples)
                 for _ in range(layout.model_chunks)]
    return iterators if layout.virtual else iterators[0]


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


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def forward_step(data_iterator, model):
    """One micro-batch through the model, as megatron's schedule calls it.

    The data loader yields CPU tensors; they go to the model's device here (an
    asynchronous copy from pinned memory on a GPU).
    """
    from megatron_sdp4bit.data import batch_to_device

    batch = batch_to_device(next(data_iterator), _model_device(model))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_mask = batch["loss_mask"].float()

    def loss_func(output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        loss = gradients_poisoned_unless_finite(loss)
        # clone: megatron's schedule divides the returned loss in place by the number
        # of micro-batches, which a plain detach() would share.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


# --- one step, one evaluation ---------------------------------------------------------

def _run_schedule(ddp, args, data_iterator, num_microbatches, forward_only) -> torch.Tensor:
    """The mean loss over the micro-batches, as a tensor on the model's device: reading
    it (a host-device synchronisation) waits for the logging interval. Pipeline stages
    other than the last have no loss: zero there (``is_loss_rank`` says which count)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_sdp4bit.training.model import model_chunks

    chunks = model_chunks(ddp)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=chunks,
        num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only,
    )
    if not losses:
        return torch.zeros((), dtype=torch.float32, device=_model_device(chunks[0]))
    return torch.stack([d["lm loss"].float() for d in losses]).mean()


def wire_schedule_hooks(ddp, optimizer) -> None:
    """What megatron's schedule calls back into, as Megatron-LM's training loop sets it:
    without ``finalize_model_grads_func`` the gradients would never be reduced. ``ddp``
    is one DDP chunk or several (virtual pipeline stages): one callback per chunk."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_sdp4bit.training.model import model_chunks

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


class NonFiniteTraining(RuntimeError):
    """The loss or the gradients stayed non-finite: training stops without saving."""


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


def train_step(ddp, optimizer, scheduler, args, data_iterator, num_microbatches):
    """One iteration; returns (loss tensor, grad norm, whether the optimizer stepped).

    megatron's optimizer skips a step whose gradients hold Inf/NaN (on every rank
    alike: the check is all-reduced); the schedule then does not advance either.
    """
    from megatron_sdp4bit.training.model import model_chunks, optimizer_checks_nonfinite

    for chunk in model_chunks(ddp):
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = _run_schedule(ddp, args, data_iterator, num_microbatches, forward_only=False)
    ok, grad_norm = optimizer_step(optimizer, optimizer_checks_nonfinite(args))
    if ok:
        scheduler.step(increment=args.global_batch_size)
    return loss, grad_norm, ok


def evaluate(ddp, args, valid, layout, num_microbatches) -> float:
    from megatron_sdp4bit.training.distributed import all_reduce_mean, is_loss_rank

    ddp.eval()
    it = _data_iterators(valid, args, layout, 0)  # the same batches at every eval
    with torch.no_grad():
        losses = [_run_schedule(ddp, args, it, num_microbatches, forward_only=True)
                  for _ in range(args.eval_iters)]
    ddp.train()
    return all_reduce_mean(torch.stack(losses).mean(), weight=float(is_loss_rank()))


# --- wire accounting ------------------------------------------------------------------

class WireMeter:
    """Bytes this rank sent vs what the exact collectives would have sent, per level.

    The patch layer is installed on every run (with quantization off it defers to
    megatron's own collectives and only counts their bytes), so the exact
    baseline run and the SDP4Bit run are measured the same way.
    """

    def __init__(self):
        from megatron_sdp4bit import comm

        self.comm = comm
        self.totals = {"sent": 0, "exact": 0, "sent_intra": 0, "sent_inter": 0}
        comm.reset_wire_stats()

    def read(self) -> dict:
        stats = self.comm.get_wire_stats()
        self.comm.reset_wire_stats()
        window = {"sent": stats.sent_bytes(), "exact": stats.exact_bytes(),
                  "sent_intra": stats.sent_bytes(level="intra"),
                  "sent_inter": stats.sent_bytes(level="inter")}
        for key, value in window.items():
            self.totals[key] += value
        return window


class TrainingWindow:
    """Loss, step count, skipped steps and wall time of the steps since the last log.

    Nothing here reads a device value per step: the losses are summed on the
    device, and the time is taken from the window's start to ``close()``, which
    waits for the device first (on a GPU, timing one step on the host would
    measure how fast kernels are queued, not how fast they run).
    """

    def __init__(self, device: str):
        self.device = device
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.steps = 0
        self.skipped = 0
        self.started = time.perf_counter()

    def start(self) -> None:
        self.loss_sum.zero_()
        self.steps = self.skipped = 0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, ok: bool) -> None:
        if ok:  # as Megatron-LM: a skipped step's loss (often Inf/NaN) is not averaged in
            self.loss_sum += loss
        self.steps += 1
        self.skipped += not ok

    def _now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def pause(self) -> None:
        """Stop the clock (evaluation and checkpoints are not training time)."""
        self.paused_at = self._now()

    def resume(self) -> None:
        self.started += time.perf_counter() - self.paused_at

    def close(self) -> tuple:
        """(loss sum over the steps not skipped, steps, skipped steps, seconds) of the
        window; then empty."""
        elapsed = self._now() - self.started
        result = (self.loss_sum.item(), self.steps, self.skipped, elapsed)
        self.steps = 0
        return result


# --- main ----------------------------------------------------------------------------

def run(args, with_weights_hash: bool = False) -> dict:
    from megatron_sdp4bit.megatron.consistency import weights_sha256
    from megatron_sdp4bit.training import checkpoint
    from megatron_sdp4bit.training.distributed import (all_reduce_mean, all_reduce_sum,
                                                       check_backend_layout, describe_placement,
                                                       init_distributed, init_model_parallel,
                                                       is_loss_rank, parallel_layout, parallel_ranks)
    from megatron_sdp4bit.training.fusions import choose_fusions
    from megatron_sdp4bit.training.metrics import MetricsLogger, plot_losses
    from megatron_sdp4bit.training.model import ModelChunks, build_model, build_optimizer

    device = init_distributed(args.distributed_backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    layout = parallel_layout(args, world)  # a bad TP/PP/VP layout stops here, naming the flag
    check_backend_layout(device, torch.distributed.get_backend(), layout)
    num_microbatches = args.global_batch_size // (args.micro_batch_size * layout.data)
    if args.save:
        checkpoint.check_writable(args.save)
    _log0(f"device: {describe_placement(device)}, "
          f"{world} ranks{f' ({layout.describe()})' if world != layout.data else ''}, "
          f"{num_microbatches} micro-batches of {args.micro_batch_size} per rank")
    init_model_parallel(args.seed, layout)  # seeds torch and megatron's RNG tracker too
    config = args.sdp4bit_config
    from megatron_sdp4bit.megatron import patch

    quantized = config is not None and config.enabled
    if config is None:  # exact collectives, counted by the layer (bit-identical to stock)
        config = preset("baseline")
    # A fresh layer: its state (step count, rounding streams, ...) starts with this run,
    # so a run's quantization noise depends on its seed only.
    patch.uninstall()
    patch.install(config)
    patch.set_metrics_interval(args.log_interval)  # sampled on logged steps only
    _log0(f"sdp4bit: {config.to_dict() if quantized else 'off (exact collectives)'}")
    if config.check_interval and layout.data > 1 and not args.use_distributed_optimizer:
        _log0("replica check (--sdp4bit-check-interval): off, it runs in the distributed optimizer's "
              "step; add --use-distributed-optimizer to have it")
    from megatron.core import parallel_state

    tokenizer, train_ds, valid_ds = build_data(args, parallel_state.get_data_parallel_rank(), layout.data)
    fusions = choose_fusions(device)
    model, _ = build_model(args, tokenizer.vocab_size, device, fusions)  # DDP chunks
    # One module for what sees the whole rank's model (checkpoints, weight hashes).
    ddp = model[0] if len(model) == 1 else ModelChunks(model)
    optimizer, scheduler = build_optimizer(args, model)
    wire_schedule_hooks(ddp, optimizer)
    # Summed over the model-parallel ranks: parameters that tensor-parallel ranks replicate
    # counted on the first, the last stage's copy of tied embeddings not at all.
    tp_first = parallel_state.get_tensor_model_parallel_rank() == 0
    n_params = all_reduce_sum(
        sum(p.numel() for p in ddp.parameters() if not getattr(p, "shared", False)
            and (tp_first or getattr(p, "tensor_model_parallel", False))),
        group=parallel_state.get_model_parallel_group())
    _log0(f"model: GPT {args.num_layers} layers x {args.hidden_size}, {n_params / 1e6:.2f} M params, "
          f"{args.transformer_impl_used} layer spec, vocab {tokenizer.vocab_size}")
    _log0(fusions.describe())
    if quantized:  # collective (plans the node layout), logged by rank 0 for its own stage
        footprint = patch.memory(optimizer, sum(p.numel() for p in ddp.parameters()))
        _log0(f"sdp4bit memory on rank 0: {footprint.describe()}")

    iteration = 0
    if args.load:
        state = checkpoint.load_checkpoint(args.load, ddp, optimizer, scheduler,
                                           fallback=getattr(args, "load_fallback", False),
                                           global_batch_size=args.global_batch_size)
        if state is not None:
            iteration = state["iteration"]
            patch.load_state_dict(state["extra"].get("sdp4bit", {}), optimizer)
            _log0(f"resumed from {args.load} at iteration {iteration}")
        else:
            _log0(f"--load {args.load}: no checkpoint there, starting from scratch")

    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    logger = MetricsLogger(run_dir, enabled=rank == 0, total_iters=args.train_iters,
                           progress_bar=not args.no_progress_bar, tensorboard_dir=args.tensorboard_dir)
    meter = WireMeter()
    train_iter = _data_iterators(train_ds, args, layout, iteration * args.global_batch_size)
    tokens_per_step = args.global_batch_size * args.seq_length
    last_loss = last_valid = math.nan
    window = TrainingWindow(device)
    tokens_total, time_total = 0, 0.0

    def save(it):
        extra = {"sdp4bit": patch.state_dict(optimizer)}
        checkpoint.save_checkpoint(args.save, it, ddp, optimizer, scheduler, extra,
                                   global_batch_size=args.global_batch_size)
        _log0(f"saved checkpoint at iteration {it} to {args.save}")

    window.start()
    consecutive_skipped = 0
    step_hashes = []
    while iteration < args.train_iters:
        loss, grad_norm, ok = train_step(ddp, optimizer, scheduler, args, train_iter, num_microbatches)
        iteration += 1
        if with_weights_hash:
            step_hashes.append(weights_sha256(ddp))
        window.add(loss, ok)
        consecutive_skipped = 0 if ok else consecutive_skipped + 1
        diverged = consecutive_skipped >= args.max_consecutive_skipped_iters
        if iteration % args.log_interval == 0 or iteration == args.train_iters or diverged:
            loss_sum, steps, skipped, elapsed = window.close()  # waits for the device
            # mean over the window's steps that were not skipped (NaN when none was) and
            # the data-parallel replicas (the last pipeline stage has the loss)
            stepped = steps - skipped
            last_loss = all_reduce_mean(loss_sum / stepped if stepped else math.nan,
                                        weight=float(is_loss_rank()))
            time_total += elapsed
            tokens_total += tokens_per_step * steps
            wire = meter.read()
            errors = patch.quantization_errors()
            logger.log("train", {
                "iteration": iteration, "loss": last_loss,
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "step_time_s": elapsed / steps,
                "tokens_per_s": tokens_per_step * steps / elapsed,
                "bytes_sent": wire["sent"], "bytes_exact": wire["exact"],
                "bytes_sent_intra": wire["sent_intra"], "bytes_sent_inter": wire["sent_inter"],
                "wire_ratio": wire["sent"] / wire["exact"] if wire["exact"] else None,
                # sampled on the window's last step: none (null) when that step was
                # skipped or quantized nothing; 0 with quantization off
                "weight_quant_rel_error": errors.get("weight") if quantized else 0.0,
                "grad_quant_rel_error": errors.get("grad_inter") if quantized else 0.0,
                "skipped": skipped,
            })
        if diverged:
            raise NonFiniteTraining(
                f"iteration {iteration}: the loss or the gradients were not finite (Inf/NaN) for "
                f"{consecutive_skipped} consecutive iterations ({iteration - consecutive_skipped + 1}"
                f"-{iteration}); the optimizer skipped each, and training stops here without "
                "saving (the last checkpoint is untouched). Lower --lr or check the data, then "
                "resume with --load; --max-consecutive-skipped-iters sets the limit")
        evaluating = iteration % args.eval_interval == 0 or iteration == args.train_iters
        saving = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
        if saving and consecutive_skipped:
            # Skipped steps left the weights as they were; a checkpoint now could only
            # become the "latest" that a resume falls into the same trouble from.
            _log0(f"iteration {iteration}: not saving, the last {consecutive_skipped} "
                  "iteration(s) were skipped (Inf/NaN)")
            saving = False
        if window.steps and (evaluating or saving):
            window.pause()
        if evaluating:
            last_valid = evaluate(ddp, args, valid_ds, layout, num_microbatches)
            logger.log("valid", {"iteration": iteration, "loss": last_valid})
        if saving:
            save(iteration)
        if window.steps == 0:
            window.start()
        elif evaluating or saving:
            window.resume()
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        save(iteration)

    summary = {
        "iterations": iteration, "final_train_loss": last_loss, "final_valid_loss": last_valid,
        "tokens_per_s": tokens_total / time_total if time_total else math.nan,
        "bytes_sent": meter.totals["sent"], "bytes_exact": meter.totals["exact"],
        "metrics": logger.path, "run_dir": run_dir,
        "replica_checks_passed": patch.replica_checks_passed(),
        "check_interval": config.check_interval,
        "layout": layout.describe(), **parallel_ranks(),
    }
    if with_weights_hash:
        summary["weights_sha256"] = weights_sha256(ddp)
        summary["weights_sha256_per_step"] = step_hashes
    logger.close()
    if rank == 0 and os.path.isfile(logger.path):
        summary["plot"] = plot_losses(logger.path, os.path.join(run_dir, "loss.png"),
                                      title=f"GPT {args.num_layers}x{args.hidden_size}"
                                      + (" with SDP4Bit" if quantized else " (exact collectives)"))
    return summary


def print_summary(summary: dict) -> None:
    if summary["bytes_exact"]:
        ratio = summary["bytes_sent"] / summary["bytes_exact"]
        wire = (f"{summary['bytes_sent'] / 2**20:.2f} MiB vs {summary['bytes_exact'] / 2**20:.2f} MiB "
                f"with the exact all-gather and FP32 reduce-scatter ({ratio:.3f}x, {1 / ratio:.2f}x less)")
    else:
        wire = "not counted (bytes are counted for the distributed optimizer's collectives only)"
    lines = [
        "", "=== summary ===",
        f"iterations          {summary['iterations']}",
        f"final train loss    {summary['final_train_loss']:.4f}",
        f"final valid loss    {summary['final_valid_loss']:.4f}",
        f"tokens/s            {summary['tokens_per_s']:.0f}",
        f"bytes sent per rank {wire}",
        f"metrics             {summary['metrics']}",
    ]
    if summary.get("replica_checks_passed"):  # none with one replica or a short run
        lines.insert(-1, f"replica checks      {summary['replica_checks_passed']} passed "
                         f"(every {summary['check_interval']} steps, all data-parallel replicas "
                         "bit-identical)")
    if summary.get("plot"):
        lines.append(f"loss curve          {summary['plot']}")
    print("\n".join(lines), flush=True)


def main(argv: Optional[list] = None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        return report_bad_flag(f"sdp4bit-pretrain: error: {exc}")
    from megatron_sdp4bit.megatron.consistency import ReplicaMismatch
    from megatron_sdp4bit.training import checkpoint
    from megatron_sdp4bit.training.distributed import shutdown

    try:
        summary = run(args)
        if torch.distributed.get_rank() == 0:
            print_summary(summary)
    except (ArgumentError, FileNotFoundError, ValueError, checkpoint.CheckpointError) as exc:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"sdp4bit-pretrain: error (rank {rank}): {exc}", file=sys.stderr)
        return 2
    except NonFiniteTraining as exc:
        if torch.distributed.get_rank() == 0:  # every rank stops alike; one says why
            print(f"sdp4bit-pretrain: stopped: {exc}", file=sys.stderr)
        return 3
    except ReplicaMismatch as exc:
        if torch.distributed.get_rank() == 0:  # every rank stops alike; one says why
            print(f"sdp4bit-pretrain: stopped: {exc}", file=sys.stderr)
        return 4
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
