"""What a Megatron-LM run would die of later, refused when its flags are parsed.

Megatron-LM builds its DDP config, model and optimizer from ``args``; the layer refuses
what it cannot quantize when they are built (``megatron/config_refusals.py``), which in a
Megatron-LM job is after initialization, as a RuntimeError traceback on every rank.
Here the same rules run on ``args`` right after they are parsed, before any process group
exists, so the job ends in one line from rank 0 (``flag_errors.report_bad_flag``: every
rank parsed the same flags) and exit code 2, before the first iteration. Each rule lives
once, in ``megatron/config_refusals.py``; this module only hands it what Megatron-LM will build.

Also refused here: a ``--save`` / ``--load`` in a checkpoint format whose checkpoints do
not carry the layer's state (the adapter's ``RouteSites.checkpoint_formats``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import traceback
from typing import Optional

from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.flag_errors import report_bad_flag

# ``args`` names Megatron-LM renames on their way into DistributedDataParallelConfig
# (training.py's DDP config; the fields with the same name are copied as they are).
_DDP_FIELDS_FROM_ARGS = {
    "reduce_scatter_with_fp32_accumulation": "ddp_reduce_scatter_with_fp32_accumulation",
}


def refuse(message: str) -> None:
    """End the job: ``message`` once, from rank 0, and exit code 2 (``report_bad_flag``)."""
    raise SystemExit(report_bad_flag(f"error: {message}"))


def megatron_lm_refusal(error: AssertionError) -> str:
    """Megatron-LM's failed argument check (``validate_args``: a bare ``assert``) as one line:
    its message, or the condition that failed, and where."""
    frames = traceback.extract_tb(error.__traceback__)
    said = " ".join(str(error).split())
    if not said:
        said = f"`{frames[-1].line}` does not hold" if frames and frames[-1].line else "an assertion failed"
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"Megatron-LM refuses these arguments: {said}{where}"


def ddp_config_as_megatron_lm_builds_it(args: argparse.Namespace):
    """The ``DistributedDataParallelConfig`` fields Megatron-LM copies from ``args``, in a
    plain namespace (megatron's dataclass checks values the checks here never read)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    values = {}
    for field in dataclasses.fields(DistributedDataParallelConfig):
        name = _DDP_FIELDS_FROM_ARGS.get(field.name, field.name)
        if hasattr(args, name):
            values[field.name] = getattr(args, name)
        elif field.default is not dataclasses.MISSING:
            values[field.name] = field.default
    return argparse.Namespace(**values)


def layer_refusal(args: argparse.Namespace, config: SDP4BitConfig) -> Optional[str]:
    """What the layer would refuse at DDP, model or optimizer construction, or None."""
    from megatron_sdp4bit.cpu_backend import cpu_training_requested
    from megatron_sdp4bit.megatron import config_refusals
    from megatron_sdp4bit.megatron.adapters import current_adapter
    from megatron_sdp4bit.megatron.background import runner_flag_refusal

    if config.enabled and getattr(args, "use_torch_fsdp2", False):
        # torch's fully_shard replaces DDP and the distributed optimizer: nothing of the
        # layer would run (and Megatron-LM refuses FSDP2 with the distributed optimizer).
        return ("SDP4Bit does not support torch FSDP2 (--use-torch-fsdp2): it quantizes the distributed "
                "optimizer's reduce-scatter and all-gather; drop --use-torch-fsdp2 and use "
                "--use-distributed-optimizer, or drop the --sdp4bit flags")
    on_cpu = cpu_training_requested()  # SDP4BIT_CPU=1: gloo on CPU ranks, whatever args say yet
    runner = runner_flag_refusal(config, "gloo" if on_cpu else getattr(args, "distributed_backend", "nccl"),
                                 "cpu" if on_cpu else "cuda")
    if runner is not None:
        return runner
    adapter = current_adapter()
    ddp_config = ddp_config_as_megatron_lm_builds_it(args)
    rules = [lambda: config_refusals.check_ddp_for(config, adapter, ddp_config)]
    if config.enabled:
        rules += [lambda: config_refusals.check_model_config(args),  # its fields are args' names
                  lambda: config_refusals.check_optimizer_config(args)]
    for rule in rules:
        try:
            rule()
        except RuntimeError as error:
            return str(error)
    return None


def checkpoint_refusal(args: argparse.Namespace, formats) -> Optional[str]:
    """A ``--save`` or ``--load`` in a format (``formats``: the release's that carry the
    layer's state) whose checkpoints would lose the layer's state, or None."""
    fmt = getattr(args, "ckpt_format", None)
    saves_or_loads = getattr(args, "save", None) or getattr(args, "load", None)
    if fmt is not None and fmt not in formats and saves_or_loads:
        return (f"--ckpt-format {fmt}: SDP4Bit's state (its step count, rounding streams and exact fp32 "
                f"main shards) is saved and restored with --ckpt-format {' or '.join(formats)} only; "
                "use one of those, or drop --save/--load")
    local = getattr(args, "non_persistent_ckpt_type", None) == "local"
    if local and getattr(args, "non_persistent_save_interval", None):
        # Megatron-LM's local checkpoint manager owns that folder's layout: the layer's
        # state has no place in it (the first such save would be refused otherwise).
        return ("--non-persistent-ckpt-type local checkpoints cannot carry SDP4Bit's state: use "
                "--non-persistent-ckpt-type global, or drop --non-persistent-save-interval")
    return None


def loop_refusal(args: argparse.Namespace) -> Optional[str]:
    """A feature of Megatron-LM's training loop that the layer cannot serve, or None."""
    if getattr(args, "inprocess_restart", False):
        # megatron tears down its groups and state and trains again in the same process;
        # the layer's (its process groups, runner, rounding-stream names) would outlive it
        return ("--inprocess-restart cannot run with SDP4Bit: the restart trains again in the same "
                "process, where the layer's process groups and state from before it would be "
                "reused, and its first quantized collective would fail; drop --inprocess-restart "
                "(a restarted job resumes from the last checkpoint with --load)")
    if getattr(args, "save_params_interval", None) and getattr(args, "overlap_param_gather", False):
        # Megatron-LM copies param.data to the host right after the optimizer step, where
        # the layer's prefetched weight gathers are still writing the weights
        return ("--save-params-interval saves the weights right after the optimizer step, while "
                "SDP4Bit's weight gathers (--overlap-param-gather) are still writing them; drop "
                "--save-params-interval or --overlap-param-gather")
    return None


def refuse_before_training(args: argparse.Namespace, config: Optional[SDP4BitConfig], formats) -> None:
    """Refuse (``refuse``) what the run with ``args`` and ``config`` would die of later;
    ``formats``: the release's checkpoint formats that carry the layer's state
    (``RouteSites.checkpoint_formats``; None where there is no Megatron-LM loop)."""
    if config is None:
        return
    message = layer_refusal(args, config)
    if message is None and config.enabled:
        message = loop_refusal(args)
    if message is None and config.enabled and formats is not None:
        message = checkpoint_refusal(args, formats)
    if message is not None:
        refuse(message)
