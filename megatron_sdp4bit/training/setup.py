"""Set-up of a training run: processes, the patch layer, data, model, optimizer, resume.

``set_up(args)`` returns the run's parts (``RunParts``) in the order every rank
builds them (the order of collectives and of random draws is part of a run's
identity: a resume continues the same curve bit for bit). Each step is a
function of its own, so a test or a script can build the parts and change one
(a hook, a schedule callback) before ``TrainingRun`` trains them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from megatron.core import parallel_state

from megatron_sdp4bit.comm.backends import backend_of
from megatron_sdp4bit.config import SDP4BitConfig, preset
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.training import checkpoint
from megatron_sdp4bit.training.checkpoint.lock import SaveLock, lock_save_folder
from megatron_sdp4bit.training.agreement import on_every_rank
from megatron_sdp4bit.training.console import is_rank0, log0
from megatron_sdp4bit.training.datasets import build_data
from megatron_sdp4bit.training.distributed import (
    ParallelLayout, all_reduce_sum, check_backend_layout, check_runner_flag, describe_placement,
    init_distributed, init_model_parallel, parallel_layout)
from megatron_sdp4bit.training.fusions import choose_fusions
from megatron_sdp4bit.training.metrics import check_run_folders, default_run_dir
from megatron_sdp4bit.training.model import ModelChunks, build_model, build_optimizer
from megatron_sdp4bit.training.out_of_memory import says_out_of_memory
from megatron_sdp4bit.training.step import wire_schedule_hooks


BUILD_SMALLER = ("build a smaller model (--num-layers, --hidden-size), or split it over more ranks "
                 "(--tensor-model-parallel-size, --pipeline-model-parallel-size)")


class NothingToTrain(RuntimeError):
    """``--load`` names a checkpoint at ``--train-iters`` already: the run is done."""


@dataclass
class RunParts:
    """Everything a run trains with, built by ``set_up``."""

    args: Any
    device: str
    """``"cuda"`` or ``"cpu"``."""
    layout: ParallelLayout
    num_microbatches: int
    """Micro-batches per data-parallel rank and iteration."""
    config: SDP4BitConfig
    """The installed layer's config (preset baseline when no SDP4Bit flag was given)."""
    quantized: bool
    tokenizer: Any
    train_ds: Any
    valid_ds: Any
    model: List[torch.nn.Module]
    """This rank's DDP chunks (one per virtual pipeline stage)."""
    ddp: torch.nn.Module
    """One module for what sees the whole rank's model (checkpoints, weight hashes)."""
    optimizer: Any
    scheduler: Any
    plan: checkpoint.ResumePlan = checkpoint.ResumePlan()
    """Where training starts: from scratch, or from the checkpoint ``--load`` names."""
    data: Optional[checkpoint.TrainingData] = None
    """What decides the training samples this run reads (recorded in its checkpoints)."""
    save_lock: Optional[SaveLock] = None
    """This job's lock on ``--save`` (rank 0), held until training ends."""

    def release(self) -> None:
        """Let another job save into ``--save`` (this run saves no more)."""
        if self.save_lock is not None:
            self.save_lock.release()

    @property
    def start_iteration(self) -> int:
        return self.plan.iteration


def start_processes(args) -> tuple:
    """(device, layout, micro-batches per rank): the process group, the parallel layout
    (a bad TP/PP/VP layout stops here, naming the flag), the output folders checked
    (``--save``, ``--run-dir``, ``--tensorboard-dir``), megatron's parallel state and
    the seeds."""
    device = init_distributed(args.distributed_backend)
    world = torch.distributed.get_world_size()
    layout = parallel_layout(args, world)
    check_backend_layout(device, backend_of(None, device), layout)
    check_runner_flag(args.sdp4bit_config, device, backend_of(None, device))
    num_microbatches = args.global_batch_size // (args.micro_batch_size * layout.data)
    if args.save:
        checkpoint.check_writable(args.save)
    args.run_dir = args.run_dir or default_run_dir()  # the logging rank's is the one written
    on_every_rank(lambda: check_run_folders(args.run_dir, args.tensorboard_dir) if is_rank0() else None)
    log0(f"device: {describe_placement(device)}, "
         f"{world} ranks{f' ({layout.describe()})' if world != layout.data else ''}, "
         f"{num_microbatches} micro-batches of {args.micro_batch_size} per rank")
    init_model_parallel(args.seed, layout)  # seeds torch and megatron's RNG tracker too
    return device, layout, num_microbatches


def install_layer(args, layout: ParallelLayout) -> tuple:
    """(config, quantized): a fresh patch layer, whose state (step count, rounding
    streams, ...) starts with this run, so a run's quantization noise depends on its
    seed only. Without SDP4Bit flags it is installed with quantization off: it then
    defers to megatron's collectives (bit-identical) and only counts their bytes."""
    config = args.sdp4bit_config
    quantized = config is not None and config.enabled
    if config is None:
        config = preset("baseline")
    patch.uninstall()
    patch.install(config)
    patch.set_metrics_interval(args.log_interval)  # sampled on logged steps only
    log0(f"sdp4bit: {config.describe()}; {config.to_dict()}" if quantized
         else "sdp4bit: off (exact collectives)")
    if config.check_interval and layout.data > 1 and not args.use_distributed_optimizer:
        log0("replica check (--sdp4bit-check-interval): off, it runs in the distributed optimizer's "
             "step; add --use-distributed-optimizer to have it")
    return config, quantized


def count_parameters(ddp) -> int:
    """The model's parameters summed over the model-parallel ranks: those that
    tensor-parallel ranks replicate counted on the first, the last stage's copy of
    tied embeddings not at all (collective)."""
    tp_first = parallel_state.get_tensor_model_parallel_rank() == 0
    return all_reduce_sum(
        sum(p.numel() for p in ddp.parameters() if not getattr(p, "shared", False)
            and (tp_first or getattr(p, "tensor_model_parallel", False))),
        group=parallel_state.get_model_parallel_group())


def build_training(args, vocab_size: int, device: str) -> tuple:
    """(DDP chunks, the whole rank's model, optimizer, scheduler), with megatron's
    schedule hooks wired."""
    fusions = choose_fusions(device)
    model, _ = build_model(args, vocab_size, device, fusions)
    ddp = model[0] if len(model) == 1 else ModelChunks(model)
    optimizer, scheduler = build_optimizer(args, model)
    wire_schedule_hooks(ddp, optimizer)
    n_params = count_parameters(ddp)
    log0(f"model: GPT {args.num_layers} layers x {args.hidden_size}, {n_params / 1e6:.2f} M params, "
         f"{args.transformer_impl_used} layer spec, vocab {vocab_size}")
    log0(fusions.describe())
    return model, ddp, optimizer, scheduler


def _check_iterations(args, plan: checkpoint.ResumePlan) -> None:
    """A checkpoint at or past ``--train-iters``: nothing to do, or a mistake. At it
    with ``--save`` elsewhere, the run saves the loaded state there at once (e.g.
    resharded to this run's data-parallel size)."""
    if plan.directory is None or plan.iteration < args.train_iters:
        return
    copies = args.save and not checkpoint.same_folder(args.save, plan.folder)
    if plan.iteration == args.train_iters and copies:
        return
    if plan.iteration == args.train_iters:
        raise NothingToTrain(f"--load {args.load} is at iteration {plan.iteration}, which is --train-iters: "
                             "nothing to train (raise --train-iters to train on)")
    raise checkpoint.CheckpointError(
        f"--load {args.load} is at iteration {plan.iteration}, past --train-iters {args.train_iters}: raise "
        f"--train-iters to train on, or --load one of its earlier checkpoints "
        f"({os.path.join(plan.folder, 'iter_NNNNNNN')})")


def plan_checkpoints(args) -> tuple:
    """Collective, before anything is built: (the checkpoint ``--load`` names, verified;
    this job's lock on ``--save``). Refused: another job saving into ``--save``, a
    ``--save`` whose checkpoints this run would replace, a checkpoint past
    ``--train-iters``."""
    lock = lock_save_folder(args.save)
    try:
        plan = checkpoint.plan_resume(args.load, args.save, fallback=args.load_fallback)
        checkpoint.check_save_folder(args.save, plan)
        _check_iterations(args, plan)
        if plan.directory is not None and not args.save:
            log0(f"--load {args.load} without --save: nothing this run trains after iteration {plan.iteration} "
                 "is saved; add --save DIR to keep it")
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return plan, lock


def resume(parts: RunParts) -> None:
    """Load the planned checkpoint, if any, into the parts (collective)."""
    args, plan = parts.args, parts.plan
    if plan.directory is None:
        return
    state = checkpoint.load_checkpoint(plan.directory, plan.manifest, parts.ddp, parts.optimizer,
                                       parts.scheduler, data=parts.data.record(plan.iteration))
    patch.load_state_dict(state["extra"].get("sdp4bit", {}), parts.optimizer)
    log0(f"resumed from {args.load} at iteration {state['iteration']}")


def set_up(args) -> RunParts:
    """Every part of the run, built in order on every rank (collective)."""
    device, layout, num_microbatches = start_processes(args)
    plan, lock = plan_checkpoints(args)
    try:
        config, quantized = install_layer(args, layout)
        tokenizer, train_ds, valid_ds = build_data(args)
        with says_out_of_memory(f"building the model (GPT {args.num_layers} layers x {args.hidden_size}) and "
                                "its optimizer", BUILD_SMALLER):
            model, ddp, optimizer, scheduler = build_training(args, tokenizer.vocab_size, device)
        if quantized:  # collective (plans the node layout), logged by rank 0 for its own stage
            footprint = patch.memory(optimizer, sum(p.numel() for p in ddp.parameters()))
            log0(f"sdp4bit memory on rank 0: {footprint.describe()}")
            for line in patch.collective_plan(model):
                log0(f"sdp4bit {line}")
            kinds, seconds = patch.kernel_warm_up()
            if seconds:  # nothing to compile where the torch reference serves (CPU)
                log0(f"sdp4bit kernels: {kinds} kinds of call compiled in {seconds:.1f} s on rank 0, "
                     "when DDP was built (not in the first step)")
        parts = RunParts(args=args, device=device, layout=layout, num_microbatches=num_microbatches,
                         config=config, quantized=quantized, tokenizer=tokenizer, train_ds=train_ds,
                         valid_ds=valid_ds, model=model, ddp=ddp, optimizer=optimizer, scheduler=scheduler,
                         plan=plan, save_lock=lock,
                         data=checkpoint.TrainingData.of_run(args, tokenizer, train_ds))
        resume(parts)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return parts
