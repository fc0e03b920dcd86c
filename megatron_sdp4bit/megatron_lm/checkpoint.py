"""The SDP4Bit layer's state in Megatron-LM's checkpoints (``--save`` / ``--load``).

Megatron-LM's checkpoint knows nothing of the layer: after ``--load`` its step count
would start at 0 again (``--sdp4bit-grad-start-iter`` would wait again), the
stochastic-rounding streams would start over, and with fp32 parameters the exact main
shards would be lost (megatron saves the reconstructed weights as its main params).
``install_checkpointing`` wraps Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``
(``RouteSites``) so that the layer's ``state_dict(optimizer)`` goes with every
checkpoint and comes back with it, bit for bit.

Where: each rank writes ``<iteration folder>/sdp4bit/rank_<global rank>.pt`` (the
folder megatron saved, ``iter_0000010/``), after megatron's own save returned. One
file per rank, beside megatron's files rather than an entry of its state dict, because
the state is per rank (each rank's rounding streams, each data-parallel rank's 1/DP
main shards) while the ``torch`` format writes its state dict on data-parallel rank 0
only, and ``torch_dist`` saves non-sharded entries from rank 0 only: one file per
rank is the same for both formats (and any other that saves an iteration folder).

A load reads the folder megatron read (what ``_load_base_checkpoint`` returned while
``load_checkpoint`` ran). Same world and data-parallel sizes: each rank takes its own
file. Another data-parallel size: the step count is taken from rank 0's file, a rank
the saved run had keeps its streams, a new rank starts its streams from the seed; the
exact fp32 main shards cannot be cut to another size here, so a checkpoint that holds
them is refused in one line. A checkpoint saved without the layer (a stock run)
resumes with the layer's step count set to megatron's iteration and fresh streams,
said in one line.
"""
from __future__ import annotations

import inspect
import os
from typing import Optional

import torch

from megatron_sdp4bit.flag_errors import report_bad_flag
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.adapters.route_sites import RouteSites
from megatron_sdp4bit.patching import Patches

FOLDER = "sdp4bit"
"""The layer's sub-folder of a Megatron-LM iteration folder."""


def rank_file(iteration_folder: str, rank: int) -> str:
    return os.path.join(iteration_folder, FOLDER, f"rank_{rank:05d}.pt")


def _refuse(line: str) -> SystemExit:
    """One line from rank 0, exit code 2 (every rank reaches the same conclusion)."""
    return SystemExit(report_bad_flag(f"sdp4bit: {line}"))


def _layout(sites: RouteSites, optimizer) -> dict:
    """What a saved state's shape depends on: world and data-parallel sizes, model parallelism."""
    args = sites.get_args()
    layer = patch.installed_layer()
    dp_rank, dp_size = layer.adapter.optimizer_group(layer.adapter.sub_optimizers(optimizer)[0])
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


def _wrap_save(sites: RouteSites, original):
    signature = inspect.signature(original)

    def save_checkpoint(*args, **kwargs):
        result = original(*args, **kwargs)
        call = signature.bind_partial(*args, **kwargs).arguments
        optimizer = call.get("optimizer")
        if patch.installed_layer() is None or optimizer is None:
            return result
        path = rank_file(_save_folder(sites, call["iteration"], call), torch.distributed.get_rank())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"layout": _layout(sites, optimizer), "state": patch.state_dict(optimizer)}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a file that exists is complete
        return result

    save_checkpoint.__wrapped__ = original
    return save_checkpoint


def _loaded_folder(checkpoint_name: str) -> str:
    """The iteration folder of what ``_load_base_checkpoint`` read: the folder itself
    (``torch_dist``) or ``<folder>/mp_rank_XX/model_optim_rng.pt`` (``torch``)."""
    if os.path.isdir(checkpoint_name):
        return checkpoint_name
    return os.path.dirname(os.path.dirname(checkpoint_name))


def _read(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a damaged file: torch's zip reader or unpickler
        raise _refuse(f"{path} is unreadable ({str(error).splitlines()[0]}): the checkpoint's SDP4Bit state "
                      "is damaged") from error


def layer_state_for_resume(folder: str, here: dict) -> Optional[dict]:
    """This rank's layer state from ``folder``, for the layout ``here`` (see the
    module docstring); None when the checkpoint was saved without the layer."""
    first = rank_file(folder, 0)
    if not os.path.exists(first):
        return None
    saved = _read(first)
    layout = saved["layout"]
    if {k: v for k, v in layout.items() if k not in ("rank", "data_parallel_rank")} == \
            {k: v for k, v in here.items() if k not in ("rank", "data_parallel_rank")}:
        own = rank_file(folder, here["rank"])
        if not os.path.exists(own):
            raise _refuse(f"{own} is missing: the checkpoint's SDP4Bit state is incomplete (the save did "
                          "not finish); load an earlier iteration (--ckpt-step)")
        return _read(own)["state"]
    if layout["model_parallel"] != here["model_parallel"] or saved["state"].get("main_shards"):
        holds = "exact fp32 main shards" if saved["state"].get("main_shards") else "model-parallel shards"
        raise _refuse(
            f"{folder} was saved with {layout['world_size']} ranks (data-parallel {layout['data_parallel_size']}, "
            f"TP/PP/CP/EP {layout['model_parallel']}) and its SDP4Bit state holds {holds} for that layout; "
            f"this run has {here['world_size']} ranks (data-parallel {here['data_parallel_size']}, TP/PP/CP/EP "
            f"{here['model_parallel']}): resume with the saved sizes")
    mine = rank_file(folder, here["rank"])
    rng = _read(mine)["state"]["rng"] if here["rank"] < layout["world_size"] and os.path.exists(mine) else {}
    return {"iteration": saved["state"]["iteration"], "rng": rng, "main_shards": {}}


def _wrap_load(sites: RouteSites, original):
    signature = inspect.signature(original)
    base_loader = getattr(sites.checkpointing, sites.base_loader)

    def load_checkpoint(*args, **kwargs):
        read = []

        def recording_base_loader(*a, **kw):
            result = base_loader(*a, **kw)
            if result[1]:
                read.append(result[1])
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
        layer = patch.installed_layer()
        if layer is None:
            return result
        _restore(sites, layer, optimizer, _loaded_folder(read[-1]), iteration)
        # megatron-core's distributed optimizer gives all parameters of torch's AdamW (no
        # Apex / Transformer Engine) one shared ``step`` tensor on load, which AdamW
        # increments once per parameter (adapter docstring).
        for sub_optimizer in layer.adapter.sub_optimizers(optimizer):
            layer.adapter.after_optimizer_load(sub_optimizer)
        return result

    load_checkpoint.__wrapped__ = original
    return load_checkpoint


def _restore(sites: RouteSites, layer, optimizer, folder: str, iteration: int) -> None:
    state = layer_state_for_resume(folder, _layout(sites, optimizer))
    if state is None:
        if torch.distributed.get_rank() == 0:
            print(f"sdp4bit: {folder} holds no SDP4Bit state (saved without --sdp4bit): the layer continues "
                  f"from step {iteration} with fresh rounding streams", flush=True)
        patch.set_iteration(iteration)
    else:
        patch.load_state_dict(state, optimizer)


MARK = "__sdp4bit_checkpointing__"
"""Carried by the wrapped ``save_checkpoint`` / ``load_checkpoint``: installed once."""


def install_checkpointing(sites: RouteSites, patches: Patches) -> None:
    """Make Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` carry the layer's
    state, until ``patches`` is restored; a second call (both routes combined) changes
    nothing. The layer is looked up at each call: a run without ``--sdp4bit`` saves and
    loads as megatron does. Checkpoint formats: ``sites.checkpoint_formats`` (the others
    are refused before training, ``refusals.py``, and so are local non-persistent
    checkpoints)."""
    if getattr(sites.save_checkpoint, MARK, False):
        return
    for original, wrap in ((sites.save_checkpoint, _wrap_save), (sites.load_checkpoint, _wrap_load)):
        wrapped = wrap(sites, original)
        setattr(wrapped, MARK, True)
        patches.set_everywhere(original, wrapped, "megatron.training")

