"""GPT pre-training on megatron-core, with SDP4Bit communication.

    torchrun --nproc-per-node 4 -m megatron_sdp4bit.pretrain --sdp4bit --bf16 \
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 ...

Megatron-LM's flag names and meanings (``training/arguments.py``). This module
only composes the parts in ``training/``: ``setup.set_up`` (processes, the patch
layer, data, model, optimizer, resume), ``run.TrainingRun`` (one step, the log /
evaluate / save policy) and the summary; ``main`` maps how a run ended to its exit
code. Without a GPU it runs on gloo with the CPU backend.
"""
from __future__ import annotations

import os
import signal
import sys
from contextlib import nullcontext
from typing import Callable, Optional

import torch

from megatron_sdp4bit.flag_errors import report_bad_flag
from megatron_sdp4bit.launcher_watch import Launcher, watch_launcher
from megatron_sdp4bit.megatron.consistency import ReplicaMismatch
from megatron_sdp4bit.training.agreement import AgreedError
from megatron_sdp4bit.training.arguments import ArgumentError, parse_args
from megatron_sdp4bit.training.checkpoint import CheckpointError
from megatron_sdp4bit.training.console import outlive_the_console
from megatron_sdp4bit.training.distributed import shutdown
from megatron_sdp4bit.training.lost_peer import LostPeer, lost_peer
from megatron_sdp4bit.training.out_of_memory import OutOfMemory
from megatron_sdp4bit.training.run_summary import print_summary, report_crash, report_stop
from megatron_sdp4bit.training.run import NonFiniteTraining, TrainingRun
from megatron_sdp4bit.training.setup import NothingToTrain, set_up
from megatron_sdp4bit.training.signals import (
    StopBeforeTraining, StoppedBySignal, StoppedDuringSetUp, interrupted_without_handler)

__all__ = ["main", "run", "NonFiniteTraining", "NothingToTrain"]


def run(args, on_step: Optional[Callable[[TrainingRun], None]] = None,
        launcher: Optional[Launcher] = None) -> dict:
    """Set up, train to ``--train-iters`` and return the summary. ``on_step(run)`` is
    called after every iteration, ``launcher`` watched (see ``TrainingRun``)."""
    # A signal during set-up stops it at once (nothing to save); while training, at
    # the next step boundary, saved (TrainingRun.train).
    with StopBeforeTraining(args.exit_signal, launcher) if args.exit_signal_handler else nullcontext():
        training = TrainingRun(set_up(args), on_step=on_step, launcher=launcher)
    training.train()
    return training.summary()


# How a run stops -> (what the line says, exit code, who says it: rank 0 while the
# others wait for the launcher; rank 0 with the others leaving at once (a signal:
# the launcher is stopping too, and a wait would outlast its grace period); each rank).
STOPS = (
    (NothingToTrain, "done", 0, "rank 0, now"),
    (StoppedBySignal, "stopped", None, "rank 0, now"),  # 128 + the signal's number
    (NonFiniteTraining, "stopped", 3, "rank 0"),
    (ReplicaMismatch, "stopped", 4, "rank 0"),
    ((ArgumentError, CheckpointError, AgreedError), "error", 2, "rank 0"),
    ((FileNotFoundError, ValueError), "error", 2, "each rank"),
    # A rank out of memory may be alone (a pipeline stage): the others are in a collective with it.
    (OutOfMemory, "error", 2, "each rank"),
    (LostPeer, "stopped", 1, "each rank"),  # one of those others: the first failure says why
)


def main(argv: Optional[list] = None) -> int:
    launcher = watch_launcher(os.environ)  # first: a rank never outlives torchrun
    outlive_the_console()  # a run stopping on a hang-up still saves
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        return report_bad_flag(f"sdp4bit-pretrain: error: {exc}")
    try:
        summary = run(args, launcher=launcher)
        if torch.distributed.get_rank() == 0:
            print_summary(summary)
        return 0
    except StoppedDuringSetUp as exc:  # not an Exception: see its docstring
        return report_stop("stopped", exc, exc.exit_code, "rank 0, now")
    except KeyboardInterrupt:  # Ctrl-C with the handler off (it is on with --save)
        stop = StoppedBySignal(interrupted_without_handler(args.save), signal.SIGINT)
        return report_stop("stopped", stop, stop.exit_code, "rank 0, now")
    except Exception as exc:
        exc = lost_peer(exc) or exc
        for kinds, kind, code, who in STOPS:
            if isinstance(exc, kinds):
                return report_stop(kind, exc, exc.exit_code if code is None else code, who)
        report_crash(exc)
        raise
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
