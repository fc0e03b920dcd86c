"""Loading a checkpoint of megatron's plain optimizer into the distributed optimizer.

A run without SDP4Bit flags and without ``--use-distributed-optimizer`` (the
driver's default, as Megatron-LM's) trains with megatron's plain optimizers, which
keep every param's fp32 main weights and Adam moments whole, on every
data-parallel rank. Resumed with ``--sdp4bit`` (which implies the distributed
optimizer), all of it is carried over: the model from its holder's file, then
each param's state cut into this rank's shards (``adapter.load_plain_optimizer_state``);
the state's indices are matched to this run's params by the names the save
recorded (``param_names``). The scheduler, the RNG states and the layer's state
are loaded as in any resume. A checkpoint of another data-parallel size (TP = PP
= 1) works alike: the plain state is the same on every saved rank; a rank the saved
run did not have reads rank 0's file.
"""
from __future__ import annotations

from megatron_sdp4bit.training.checkpoint.common import CheckpointError, adapter, model_holder, rank_and_world, rank_file
from megatron_sdp4bit.training.checkpoint.model_record import load_model
from megatron_sdp4bit.training.checkpoint.overrides import align_saved_groups, group_settings, settle_schedule
from megatron_sdp4bit.training.checkpoint.reshard import read_rank_file
from megatron_sdp4bit.training.checkpoint.rng_state import set_rng_state


def _saved_params(names: list, params: dict, directory: str) -> list:
    """This run's params for the saved state's names, per param group."""
    missing = [name for group in names for name in group if name not in params]
    if missing:
        raise CheckpointError(f"checkpoint {directory} holds optimizer state of {missing[0]}, which this run's "
                              "model does not have")
    return [[params[name] for name in group] for group in names]


def load_converted(directory: str, saved_layout: dict, model, optimizer, scheduler, global_batch_size) -> dict:
    """Load ``directory`` (saved with megatron's plain optimizer, ``saved_layout``) into
    this run's distributed optimizer."""
    rank, _ = rank_and_world()
    asked = group_settings(optimizer)
    state = read_rank_file(rank_file(directory, rank if rank < saved_layout["world_size"] else 0))
    model_state = state["model"]
    if model_state is None:  # another data-parallel size has TP = PP = 1: the holder is rank 0
        model_state = read_rank_file(rank_file(directory, model_holder()[1]), mmap=True)["model"]
    load_model(model, model_state, directory)
    sub_optimizers = adapter().sub_optimizers(optimizer)
    if len(sub_optimizers) != len(state["optimizer"]):
        raise CheckpointError(f"checkpoint {directory} holds {len(state['optimizer'])} optimizers' state, this "
                              f"run has {len(sub_optimizers)}")
    saved_groups = align_saved_groups(sub_optimizers, state["optimizer"])
    params = dict(model.named_parameters())
    for opt, opt_state, names in zip(sub_optimizers, state["optimizer"], state["param_names"]):
        adapter().load_plain_optimizer_state(opt, opt_state, _saved_params(names, params, directory))
        adapter().after_optimizer_load(opt)
    settle_schedule(state, directory, optimizer, scheduler, asked, saved_groups, global_batch_size)
    set_rng_state(state["rng"])
    return state

