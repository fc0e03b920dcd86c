"""Where the layer's collectives run while megatron overlaps them (``comm/runner.py``).

With ``--overlap-grad-reduce`` or ``--overlap-param-gather`` megatron starts a
bucket's collective and goes on with the backward (forward) pass, waiting on the
handle only in ``finish_grad_sync`` (the forward pre-hook). The layer hands every
stage of its collectives to one runner, chosen when the first model chunk's DDP
is built and kept for the run:

- gloo: a worker thread (``ThreadRunner``) on private twins of the data-parallel
  groups, made here on every rank in the same order, so its collectives never
  pair with megatron's own on the same group;
- NCCL on CUDA: a side stream (``StreamRunner``) ordered after the compute stream,
  also on private twins, so megatron's own collectives on those groups never queue
  behind its hops (NCCL runs one communicator's collectives in issue order);
  with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (megatron asks for it under tensor or context
  parallelism) a side stream whose stages are issued at megatron's later calls
  (``DeferringRunner``), said in one INFO line;
- every rank must choose the same (``check_same_kind_everywhere``: one line otherwise);
- any other backend, or no overlap flag: the caller (``InlineRunner``); with an
  overlap flag one INFO line says the quantized collectives are not overlapped;
- ``--sdp4bit-runner`` (``SDP4BitConfig.runner``) other than ``auto``: the runner it
  names, said in one INFO line, or one error line where it cannot run.

Every rank submits its bucket groups' collectives in megatron's order, and one
runner runs them in that order: see docs/collectives.md, "Overlap", for why this
cannot deadlock.
"""
from __future__ import annotations

import logging
import os

import torch

from megatron_sdp4bit.comm.backends import backend_of
from megatron_sdp4bit.comm.runner import InlineRunner
from megatron_sdp4bit.comm.layout import ONE_QUEUE_WHOLE_BUCKET_ELEMENTS
from megatron_sdp4bit.comm.runner_choice import (
    check_same_kind_everywhere, make_runner, requested_kind, runner_refusal)
from megatron_sdp4bit.comm.topology import build_private_groups, private_group
from megatron_sdp4bit.megatron.hop_plan import RUNNER_WORDS

logger = logging.getLogger(__name__)


def runner_flag_error(requested: str, why: str) -> str:
    """The one line that refuses ``--sdp4bit-runner requested`` (``why``:
    ``comm.runner_choice.runner_refusal``'s reason)."""
    return (f"--sdp4bit-runner {requested} cannot run here: {why}; leave it at auto (the "
            "runner for this backend)")


def runner_flag_refusal(config, backend: str, device_type: str):
    """``runner_flag_error`` where ``config``'s runner cannot run on ``backend`` with
    ``device_type`` tensors, else None: for front ends that know both before any DDP is
    built (the driver, Megatron-LM's route), whether or not megatron will overlap."""
    why = None if config is None else runner_refusal(config.runner, backend, device_type)
    return None if why is None else runner_flag_error(config.runner, why)


def _one_queue(kind: str) -> str:
    """``kind``, or ``"deferred"`` for a side stream under ``CUDA_DEVICE_MAX_CONNECTIONS=1``:
    one hardware queue for every stream, where a wait for a hop still in flight blocks the
    queue, and the pass's kernels issued after it with it."""
    if kind == "stream" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return "deferred"
    return kind


def set_up_runner(state, adapter, ddp, groups, rank_lists) -> None:
    """Choose ``state.runner`` at the first DDP construction that overlaps, and give a
    runner that asks for them (``private_groups``: the thread and stream runners) private
    twins of ``groups`` (``rank_lists``: every rank's lists of each,
    a world collective made by the caller). Called by every rank at every DDP
    construction, in the same order."""
    ddp_config = adapter.ddp_config(ddp)
    # rank_lists, not this rank's groups: the same on every rank, so every rank makes the
    # same world collectives below (build_private_groups)
    if not (ddp_config.overlap_grad_reduce or ddp_config.overlap_param_gather) or not rank_lists:
        return
    bucket_groups = adapter.ddp_bucket_groups(ddp)
    # (a model chunk with no bucket group still takes part in the world collectives below)
    device = (adapter.grad_buffers(bucket_groups[0])[0].device if bucket_groups else
              torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    if isinstance(state.runner, InlineRunner) and not state.runner_chosen:
        state.runner_chosen = True
        # (a rank may hold no group of its own here: megatron makes them all with the
        # world's backend)
        group = groups[0] if groups else torch.distributed.group.WORLD
        requested = state.config.runner
        try:
            kind = requested_kind(requested, group, device)
        except ValueError as error:  # the driver and Megatron-LM's route refuse it earlier
            raise RuntimeError(f"SDP4Bit: {runner_flag_error(requested, str(error))}") from None
        if requested == "auto":
            kind = _one_queue(kind)
        check_same_kind_everywhere(kind)
        if requested != "auto":
            logger.info("SDP4Bit: --sdp4bit-runner %s: %s", requested, RUNNER_WORDS[requested])
            if kind == "inline":
                return
        elif kind == "inline":
            logger.info("SDP4Bit: the %s backend cannot run collectives from a worker thread or a "
                        "side stream; the quantized collectives run when megatron starts them, "
                        "not overlapped with the backward and forward passes",
                        backend_of(group, device))
            return
        elif kind == "deferred":
            logger.info("SDP4Bit: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream in one "
                        "hardware queue, where a wait for an NCCL hop in flight holds up the "
                        "kernels queued after it; each stage of a quantized collective is "
                        "issued at megatron's next start or wait instead, a bucket of up to "
                        "%d M elements in one chunk, and the weight gathers start one bucket "
                        "group ahead, as megatron starts them. Unset it where megatron allows "
                        "(tensor and context parallel size 1, or Blackwell GPUs) to issue every "
                        "stage at once", ONE_QUEUE_WHOLE_BUCKET_ELEMENTS >> 20)
        state.runner = make_runner(kind, device)
    if not getattr(state.runner, "private_groups", False):
        return
    for lists in rank_lists:
        build_private_groups(lists)
    for group in groups:
        private_group(group)  # every group the runner will be asked for has its twin
