"""What the Megatron-LM routes hook in ``megatron.training``, as a typed record.

An adapter's ``megatron_lm_sites()`` returns a ``RouteSites``; ``megatron_sdp4bit.megatron_lm``
applies it (the launcher and the patch in ``patches/``). The objects are Megatron-LM's own,
looked up by the adapter when asked (``megatron.training`` is imported then), so a name
that moved fails in the adapter, by name. Why each is hooked is written where it is
hooked: ``megatron_lm/dataset_helpers.py``, ``checkpoint.py``, ``reporting.py``,
``refusals.py``, ``routes.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Tuple

from megatron_sdp4bit.megatron.adapters.cpu_sites import Site


@dataclass(frozen=True)
class RouteSites:
    """Megatron-LM's functions the routes wrap, and the names they call by."""

    compile_helpers: Site
    """``core/datasets/utils.py`` ``compile_helpers``: ``make`` in the dataset folder, run by
    rank 0 at initialization (looked up at call time)."""
    checkpointing: ModuleType
    """``training/checkpointing.py``: its ``save_checkpoint`` / ``load_checkpoint`` call the
    two names below as module globals."""
    save_checkpoint: Callable
    """Rebound wherever ``megatron.training`` binds it."""
    load_checkpoint: Callable
    """Rebound wherever ``megatron.training`` binds it."""
    state_dict_builder: str
    """``generate_state_dict``: the state a checkpoint saves, and the template of a
    ``torch_dist`` load."""
    base_loader: str
    """``_load_base_checkpoint``: returns what a load read (common state first for
    ``torch_dist``, then every shard)."""
    checkpoint_formats: Tuple[str, ...]
    """``--ckpt-format`` values whose checkpoints carry the layer's state."""
    training: ModuleType
    """``training/training.py``: ``pretrain`` calls ``train`` and ``train`` calls
    ``training_log`` by these names, as module globals."""
    training_log: str
    """Megatron-LM's per-iteration log (stdout line, TensorBoard, W&B)."""
    log_printer: str
    """The name ``training_log`` prints its iteration line with (``print_rank_last``)."""
    train: str
    """The training loop; returns (or exits) after the last iteration."""
    params_norm: str
    """The name ``train`` computes ``--log-params-norm`` with (``calc_params_l2_norm``),
    right after the optimizer step, reading the weights."""
    validate_args: Callable
    """``training/arguments.py`` ``validate_args``: Megatron-LM's checks of its arguments (bare
    ``assert``\ s), rebound wherever ``megatron.training`` binds it."""
    get_args: Callable
    """``training/global_vars.py`` ``get_args``: the parsed arguments (``--save``, ``--log-interval``)."""
    writers: Tuple[Callable, Callable]
    """``get_tensorboard_writer`` and ``get_wandb_writer`` (``training/global_vars.py``): each
    returns its writer on the rank that logs, else None."""
