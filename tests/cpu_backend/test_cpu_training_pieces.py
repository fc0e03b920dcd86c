"""Pieces of the CPU mode for Megatron-LM's loop, checked without Megatron-LM.

- ``megatron_args.settle_args_for_cpu``: what a CPU run needs is set on the parsed
  arguments (and said), whatever the user gave; nothing else is touched.
- ``checkpoint_worker``: megatron's persistent checkpoint worker runs in a spawned
  process; the replacement the CPU mode puts on its class is found there by import, and
  runs the class's own loop with ``torch.cuda`` as one CPU device (before: the worker
  divided by ``torch.cuda.device_count()``, 0, died, and the first save waited forever).
The whole of both runs in ``test_megatron_training_loop.py`` / ``test_megatron_lm_checkpoints.py``.
"""
from __future__ import annotations

import argparse
import multiprocessing
import pickle

import torch

from megatron_sdp4bit.cpu_backend import checkpoint_worker, cpu_training_requested
from megatron_sdp4bit.cpu_backend.megatron_args import CPU_SETTINGS, settle_args_for_cpu
from megatron_sdp4bit.patching import Patches


def _megatron_lm_defaults(**given):
    defaults = dict(transformer_impl="transformer_engine", no_persist_layer_norm=False,
                    gradient_accumulation_fusion=True, masked_softmax_fusion=True, bias_gelu_fusion=True,
                    bias_dropout_fusion=True, apply_rope_fusion=True, distributed_backend="nccl", num_layers=2)
    return argparse.Namespace(**{**defaults, **given})


def test_the_defaults_are_set_for_cpu_and_named():
    args = _megatron_lm_defaults()
    changed = settle_args_for_cpu(args, {})
    assert changed == [flag for flag, _, _ in CPU_SETTINGS]
    assert (args.transformer_impl, args.no_persist_layer_norm, args.gradient_accumulation_fusion,
            args.masked_softmax_fusion, args.bias_gelu_fusion, args.bias_dropout_fusion,
            args.apply_rope_fusion, args.distributed_backend) == ("local", True, False, False, False, False,
                                                                  False, "gloo")
    assert args.num_layers == 2
    assert settle_args_for_cpu(args, {}) == []  # already right: nothing to say


def test_tensor_parallelism_gets_the_connections_megatron_lm_asks_for():
    """Before: "Using tensor model parallelism or context parallelism require setting the
    environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1" (an AssertionError on every rank)."""
    environ = {}
    args = _megatron_lm_defaults(transformer_impl="local", tensor_model_parallel_size=2, context_parallel_size=1)
    assert settle_args_for_cpu(args, environ)[-1] == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" not in settle_args_for_cpu(args, environ)  # already set
    no_tp = _megatron_lm_defaults(tensor_model_parallel_size=1, context_parallel_size=1)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" not in settle_args_for_cpu(no_tp, {})


def test_only_what_is_not_already_set_is_named():
    args = _megatron_lm_defaults(transformer_impl="local", bias_gelu_fusion=False)
    delattr(args, "apply_rope_fusion")  # a release without that flag
    changed = settle_args_for_cpu(args, {})
    assert "--transformer-impl local" not in changed and "--no-bias-gelu-fusion" not in changed
    assert "--no-rope-fusion" not in changed and not hasattr(args, "apply_rope_fusion")
    assert "--no-persist-layer-norm" in changed


def test_sdp4bit_cpu_values():
    assert cpu_training_requested({"SDP4BIT_CPU": "1"}) and cpu_training_requested({"SDP4BIT_CPU": "yes"})
    assert not cpu_training_requested({}) and not cpu_training_requested({"SDP4BIT_CPU": "0"})
    assert not cpu_training_requested({"SDP4BIT_CPU": ""})


class StandInCaller:
    """Like megatron's PersistentAsyncCaller: the loop a static method, started as a process target."""

    @staticmethod
    def async_loop(rank, queue):
        torch.cuda.set_device(rank % torch.cuda.device_count())  # megatron's first line
        torch.cuda.synchronize()
        queue.put(("ran", rank, torch.cuda.device_count()))


SITE = (StandInCaller, "async_loop")


def test_the_worker_loop_runs_in_a_spawned_process_with_one_cpu_device():
    original = vars(StandInCaller)["async_loop"]
    with Patches("test") as patches:
        checkpoint_worker.redirect_worker(SITE, patches)
        target = StandInCaller.async_loop  # what megatron hands multiprocessing
        pickle.loads(pickle.dumps(target))  # found by import in the worker
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        worker = context.Process(target=target, args=(3, queue))
        worker.start()
        worker.join(120)
        assert worker.exitcode == 0
        # In the worker the class is megatron's own (its loop ran, not the replacement again).
        assert queue.get(timeout=10) == ("ran", 3, 1)
    assert vars(StandInCaller)["async_loop"] is original and not hasattr(StandInCaller, checkpoint_worker.ORIGINAL)
    assert torch.cuda.device_count.__module__ == "torch.cuda"  # here torch.cuda is as it was


def test_the_worker_loop_runs_where_the_cpu_mode_is_on_too():
    """Spawning re-runs the training script's top level in the worker; a script that enables
    the CPU mode there redirects the worker's class too. Before: the replacement called
    itself (RecursionError), the worker died, and the save waited for it for good."""
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    with Patches("test") as patches:
        checkpoint_worker.redirect_worker(SITE, patches)
        StandInCaller.async_loop(5, queue)  # as the worker with the CPU mode on calls it
    assert queue.get() == ("ran", 5, 1)
