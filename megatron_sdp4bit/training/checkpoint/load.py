"""Loading a checkpoint, decided alike on every rank.

Three steps, all collective, so no rank starts (or says it resumed) when another
cannot: the files were verified when the checkpoint was chosen
(``folders.plan_resume``, ``manifest.choose_checkpoint``); here the saved layout is
compared with this run's (``layout.compare_layouts``: refuse, warn, or reshard),
then the state is loaded, with the outcome agreed between the ranks.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.training.checkpoint.common import (
    LATEST, RANK_FILE, CheckpointError, adapter, all_gather, first_line, model_holder, rank_and_world,
    rank_file)
from megatron_sdp4bit.training.checkpoint.convert import load_converted
from megatron_sdp4bit.training.checkpoint.run_layout import compare_layouts, converts, current_layout
from megatron_sdp4bit.training.checkpoint.model_record import load_model
from megatron_sdp4bit.training.checkpoint.overrides import align_saved_groups, group_settings, settle_schedule
from megatron_sdp4bit.training.checkpoint.reshard import load_resharded, read_rank_file
from megatron_sdp4bit.training.checkpoint.rng_state import set_rng_state
from megatron_sdp4bit.training.console import log0


def latest_iteration(load_dir: str) -> Optional[int]:
    """The iteration the tracker file names; None without one."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def _legacy_layout(directory: str) -> dict:
    """What a checkpoint without a manifest tells of its layout: its number of rank files
    (and nothing of its data: ``choose_checkpoint``'s warning says so)."""
    ranks = [n for n in os.listdir(directory) if RANK_FILE.match(n)]
    return {"world_size": len(ranks), "data_parallel_size": len(ranks),
            "tensor_model_parallel_size": None, "pipeline_model_parallel_size": None, "data": {}}


def _load_same_layout(directory: str, _saved_layout: dict, model, optimizer, scheduler,
                      global_batch_size: Optional[int]) -> dict:
    rank, _ = rank_and_world()
    asked = group_settings(optimizer)
    state = read_rank_file(rank_file(directory, rank))
    model_state = state["model"]
    if model_state is None:
        model_state = read_rank_file(rank_file(directory, model_holder()[1]), mmap=True)["model"]
    load_model(model, model_state, directory)
    saved_groups = align_saved_groups(adapter().sub_optimizers(optimizer), state["optimizer"])
    for opt, opt_state, param_state in zip(adapter().sub_optimizers(optimizer), state["optimizer"],
                                           state["param_state"]):
        opt.load_state_dict(opt_state)
        if param_state is not None:
            adapter().load_parameter_state(opt, param_state)
        adapter().after_optimizer_load(opt)
    settle_schedule(state, directory, optimizer, scheduler, asked, saved_groups, global_batch_size)
    set_rng_state(state["rng"])
    return state


def _agreed_layout(directory: str, saved_layout: dict, model, optimizer, data: Optional[dict]) -> tuple:
    """Collective: (reshard, this run's layout), or the first rank's refusal on every rank
    (a pipeline stage may differ alone)."""
    layout = current_layout(model, optimizer, data=data)
    reshard, warnings, refusal = False, [], None
    try:
        reshard, warnings = compare_layouts(directory, saved_layout, layout)
    except CheckpointError as exc:
        refusal = str(exc)
    refusals = [r for r in all_gather(refusal) if r]
    if refusals:
        raise CheckpointError(refusals[0])
    for line in warnings:
        log0(line)
    return reshard, layout


def _agreed_load(directory: str, saved_layout: dict, layout: dict, reshard: bool, model, optimizer, scheduler,
                 global_batch_size: Optional[int]) -> dict:
    """Collective: load on every rank; a failure on any rank raises on every rank."""
    rank, _ = rank_and_world()
    error, failure, state = None, None, None
    loader = load_converted if converts(saved_layout, layout) else load_resharded if reshard else _load_same_layout
    try:
        with torch.no_grad():  # fp32 params: megatron's main params are views of them
            state = loader(directory, saved_layout, model, optimizer, scheduler, global_batch_size)
        misfit = patch.main_shards_refusal((state.get("extra") or {}).get("sdp4bit"), optimizer)
        if misfit is not None:
            raise CheckpointError(f"{directory}: {misfit}")
    except Exception as exc:  # agreed below, so that no rank goes on alone
        error, failure = exc, f"rank {rank}: {first_line(exc)}"
    failures = [f for f in all_gather(failure) if f]
    if error is not None:
        raise error
    if failures:
        raise CheckpointError(f"loading {directory} failed on {failures[0]}")
    return state


def load_checkpoint(directory: str, manifest: Optional[dict], model, optimizer, scheduler,
                    data: Optional[dict] = None) -> dict:
    """Restore everything ``save_checkpoint`` saved in ``directory`` (a checkpoint
    ``choose_checkpoint`` verified, with its ``manifest``; None for an older save).

    Collective. Compares the checkpoint's layout with this run's before anything
    is loaded, and raises ``CheckpointError`` on every rank alike when any rank
    cannot load. ``data``: what decides this run's training samples at the
    checkpoint's iteration (``TrainingData.record``), refused when it differs from the
    recorded one (``training_data.compare_data``). The returned state carries ``directory``; its
    ``extra["sdp4bit"]`` is the layer's state for this rank, resharded when the
    data-parallel size changed.
    """
    saved_layout = manifest["layout"] if manifest is not None else _legacy_layout(directory)
    reshard, layout = _agreed_layout(directory, saved_layout, model, optimizer, data)
    global_batch_size = (data or {}).get("global_batch_size")  # the schedule's lines count iterations
    if converts(saved_layout, layout):
        log0(f"{directory} was saved with megatron's plain optimizer, this run has the distributed one: every "
             "param's fp32 main weights, Adam moments and step are carried over into this run's shards")
    elif reshard:
        log0(f"{directory} was saved with data-parallel size {saved_layout['data_parallel_size']}, "
             f"this run has {layout['data_parallel_size']}: resharding the optimizer state")
    state = _agreed_load(directory, saved_layout, layout, reshard, model, optimizer, scheduler, global_batch_size)
    state["directory"] = directory
    return state
