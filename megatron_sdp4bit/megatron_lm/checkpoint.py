"""The SDP4Bit layer's state in Megatron-LM's checkpoints (``--save`` / ``--load``).

Megatron-LM's checkpoint knows nothing of the layer: after ``--load`` its step count
would start at 0 again (``--sdp4bit-grad-start-iter`` would wait again), the
stochastic-rounding streams would start over, and with fp32 parameters the exact main
shards would be lost (megatron saves the reconstructed weights as its main params).
``install_checkpointing`` wraps Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``
(``RouteSites``) so that the layer's ``state_dict(optimizer)`` goes with every
checkpoint and comes back with it, bit for bit.

Where: each rank writes ``<iteration folder>/sdp4bit/rank_<global rank>.pt`` (the
folder megatron saves, ``iter_0000010/``) before megatron's own save runs: that save
ends by naming the iteration in its tracker file (``latest_checkpointed_iteration.txt``,
and with ``--save-retain-interval`` it then deletes the previous one), and a job killed
between the tracker and a later write of the layer's files would leave a latest
checkpoint that ``--sdp4bit`` refuses. The layer's state is final there (megatron's
``force_param_sync`` ran, ``state_dict`` drains the runner). A non-persistent save
(``--non-persistent-save-interval``, global) writes them after, as megatron keeps only
the newest ``iter_*`` folder there when a save starts: one of the layer's own would
make it delete the last complete one. One file per rank, beside megatron's files rather
than an entry of its state dict, because the state is per rank (each rank's rounding
streams, each data-parallel rank's 1/DP main shards) while the ``torch`` format writes
its state dict on data-parallel rank 0 only, and ``torch_dist`` saves non-sharded
entries from rank 0 only: one file per rank is the same for both formats (and any other
that saves an iteration folder).

A load reads the folder megatron read (what ``_load_base_checkpoint`` returned while
``load_checkpoint`` ran) and what the checkpoint's saved args asked for; which state
each rank takes, and the one outcome all ranks agree on before any goes on (resume, a
stock checkpoint said in one line, or a refusal in one line naming the file), is
``resume_state.py``'s. A run without ``--sdp4bit`` that loads a checkpoint saved with it
says in one line that it leaves that state unused.
"""
from __future__ import annotations

import inspect
import logging
import os
from typing import Optional

import torch

from megatron_sdp4bit.flag_errors import report_bad_flag
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.adapters.route_sites import RouteSites
from megatron_sdp4bit.megatron.args import SDP4BitFlagError, config_from_args
from megatron_sdp4bit.megatron_lm import resume_state
from megatron_sdp4bit.megatron_lm.resume_state import FOLDER, rank_file
from megatron_sdp4bit.patching import Patches


def _refuse(line: str) -> SystemExit:
    """One line from rank 0, exit code 2 (every rank reaches the same conclusion)."""
    return SystemExit(report_bad_flag(f"sdp4bit: {line}"))


def _layout(sites: RouteSites, optimizer) -> dict:
    """What a saved state's shape depends on: world and data-parallel sizes, model parallelism."""
    args = sites.get_args()
    dp_rank, dp_size = patch.optimizer_group(optimizer)
    return {"world_size": torch.distributed.get_world_size(), "rank": torch.distributed.get_rank(),
            "data_parallel_size": dp_size, "data_parallel_rank": dp_rank,
            "model_parallel": [int(getattr(args, name, 1) or 1) for name in
                               ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                "context_parallel_size", "expert_model_parallel_size")]}


def _save_folder(sites: RouteSites, iteration: int, call: dict) -> str:
    """The iteration folder ``save_checkpoint`` wrote (its own choice of directory)."""
    args = sites.get_args()
    save_dir = args.save
    if call.get("non_persistent_ckpt", False):  # global: local ones are refused before training
        save_dir = args.non_persistent_global_ckpt_dir or os.path.join(
            save_dir, sites.checkpointing._NON_PERSISTENT_CKPT_SUBDIR)
    return sites.checkpointing.get_checkpoint_name(save_dir, iteration, release=call.get("release", False),
                                                   return_base_dir=True)


def _write_rank_file(sites: RouteSites, optimizer, folder: str) -> None:
    path = rank_file(folder, torch.distributed.get_rank())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"layout": _layout(sites, optimizer), "state": patch.state_dict(optimizer)}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a file that exists is complete


OVERWRITING = "Overwriting old incomplete / corrupted checkpoint"
"""megatron-core's warning (``dist_checkpointing.save``, ``torch_dist``) when the folder it
saves into is not empty."""


class _OnlyTheLayersFolder(logging.Filter):
    """Drops ``OVERWRITING`` while ``folder`` holds nothing but the layer's own files, which
    were written there first on purpose; any other content keeps the warning."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(OVERWRITING):
            return True
        try:
            return os.listdir(self.folder) != [FOLDER]
        except OSError:
            return True


def _wrap_save(sites: RouteSites, original):
    signature = inspect.signature(original)
    megatrons_warning = logging.getLogger("megatron.core.dist_checkpointing.serialization")

    def save_checkpoint(*args, **kwargs):
        call = signature.bind_partial(*args, **kwargs).arguments
        optimizer = call.get("optimizer")
        if not patch.is_installed() or optimizer is None:
            return original(*args, **kwargs)
        folder = _save_folder(sites, call["iteration"], call)
        if call.get("non_persistent_ckpt", False):
            result = original(*args, **kwargs)
            _write_rank_file(sites, optimizer, folder)
            return result
        _write_rank_file(sites, optimizer, folder)  # before megatron names the iteration
        quiet = _OnlyTheLayersFolder(folder)
        megatrons_warning.addFilter(quiet)
        try:
            return original(*args, **kwargs)
        finally:
            megatrons_warning.removeFilter(quiet)

    save_checkpoint.__wrapped__ = original
    return save_checkpoint


def _loaded_folder(checkpoint_name: str) -> str:
    """The iteration folder of what ``_load_base_checkpoint`` read: the folder itself
    (``torch_dist``) or ``<folder>/mp_rank_XX/model_optim_rng.pt`` (``torch``)."""
    if os.path.isdir(checkpoint_name):
        return checkpoint_name
    return os.path.dirname(os.path.dirname(checkpoint_name))


def saved_with_layer(state_dict) -> Optional[bool]:
    """Whether the args a checkpoint saved asked for quantization (then it holds the
    layer's files); None when it saved no args."""
    saved_args = state_dict.get("args") if isinstance(state_dict, dict) else None
    if saved_args is None:
        return None
    try:
        config = config_from_args(saved_args)
    except SDP4BitFlagError:  # flags of a newer or older release: it had some
        return True
    return config is not None and config.enabled


def _wrap_load(sites: RouteSites, original):
    signature = inspect.signature(original)
    base_loader = getattr(sites.checkpointing, sites.base_loader)

    def load_checkpoint(*args, **kwargs):
        read = []  # (folder name, saved args asked for the layer) of each base load

        def recording_base_loader(*a, **kw):
            result = base_loader(*a, **kw)
            if result[1]:
                read.append((result[1], saved_with_layer(result[0])))
            return result

        # no_grad: megatron-core 0.19's ``load_parameter_state_from_dp_zero`` (--ckpt-format
        # torch) lacks the @torch.no_grad() of its siblings, and with fp32 parameters its
        # main params are views of leaf params that require grad: "a view of a leaf
        # Variable that requires grad is being used in an in-place operation". A load
        # needs no autograd.
        with Patches("SDP4Bit checkpoints") as during_load, torch.no_grad():
            during_load.set(sites.checkpointing, sites.base_loader, recording_base_loader)
            result = original(*args, **kwargs)
        optimizer = signature.bind_partial(*args, **kwargs).arguments.get("optimizer")
        iteration = result[0]
        if optimizer is None or not read or iteration == 0:
            return result
        name, with_layer = read[-1]
        if not patch.is_installed():
            _say_unused(_loaded_folder(name), with_layer)
            return result
        _restore(sites, optimizer, _loaded_folder(name), with_layer, iteration)
        # megatron-core's distributed optimizer gives all parameters of torch's AdamW (no
        # Apex / Transformer Engine) one shared ``step`` tensor on load, which AdamW
        # increments once per parameter (adapter docstring).
        patch.after_optimizer_load(optimizer)
        return result

    load_checkpoint.__wrapped__ = original
    return load_checkpoint


def _say_unused(folder: str, with_layer: Optional[bool]) -> None:
    """A run without the layer resuming a checkpoint that holds its state: one line."""
    if torch.distributed.get_rank() == 0 and (with_layer or os.path.isdir(os.path.join(
            folder, resume_state.FOLDER))):
        print(f"sdp4bit: {folder} was saved with --sdp4bit; this run has no --sdp4bit, so it continues with "
              "exact collectives from the weights Megatron-LM saved, leaving the checkpoint's SDP4Bit state "
              "(rounding streams, exact fp32 main shards) unused: add --sdp4bit to continue the quantized run",
              flush=True)


def _restore(sites: RouteSites, optimizer, folder: str, with_layer: Optional[bool],
             iteration: int) -> None:
    """This rank's state from ``folder``, once every rank has decided alike (``resume_state``)."""
    try:
        decision = resume_state.decide(folder, _layout(sites, optimizer), with_layer)
        misfit = patch.main_shards_refusal(decision, optimizer)
        if misfit is not None:
            decision = resume_state.Refused(f"{folder}: {misfit}")
    except resume_state.Refused as refused:
        decision = refused
    except Exception as error:  # raised here alone, it would leave the other ranks in the all-gather
        decision = resume_state.Refused(
            f"{folder}: rank {torch.distributed.get_rank()} cannot take its SDP4Bit state ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no message'}); load an earlier iteration "
            "(--ckpt-step), or resume this one without --sdp4bit")
    reports = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reports, resume_state.report(decision))
    refusal = resume_state.agree(folder, reports)
    if refusal is not None:
        raise _refuse(refusal)
    if decision is None:
        if torch.distributed.get_rank() == 0:
            print(f"sdp4bit: {folder} holds no SDP4Bit state (saved without --sdp4bit): the layer continues "
                  f"from step {iteration} with fresh rounding streams", flush=True)
        patch.set_iteration(iteration)
    else:
        patch.load_state_dict(decision, optimizer)


MARK = "__sdp4bit_checkpointing__"
"""Carried by the wrapped ``save_checkpoint`` / ``load_checkpoint``: installed once."""


def install_checkpointing(sites: RouteSites, patches: Patches) -> None:
    """Make Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` carry the layer's
    state, until ``patches`` is restored; a second call (both routes combined) changes
    nothing. Whether a layer is installed is asked at each call: a run without
    ``--sdp4bit`` saves and loads as megatron does (saying so when what it loads holds
    the layer's state). Checkpoint formats: ``sites.checkpoint_formats`` (the others
    are refused before training, ``refusals.py``, and so are local non-persistent
    checkpoints)."""
    if getattr(sites.save_checkpoint, MARK, False):
        return
    for original, wrap in ((sites.save_checkpoint, _wrap_save), (sites.load_checkpoint, _wrap_load)):
        wrapped = wrap(sites, original)
        setattr(wrapped, MARK, True)
        patches.set_everywhere(original, wrapped, "megatron.training")

