"""Flags whose values a checkpoint holds too: the learning-rate schedule and Adam's
hyper-parameters.

Loading megatron-core's scheduler state replaces this run's ``--lr``, ``--min-lr``,
warm-up, ``--lr-decay-iters``, decay style and weight decay by the checkpoint's
(its default), and loading the optimizer's state replaces its param groups: the
``max_lr`` / ``min_lr`` megatron's scheduler reads the learning rate from, and
``--adam-beta1/2`` and ``--adam-eps``. A resume that asks for another schedule
(extending a run with a longer ``--train-iters``) would silently train at the old
one. As in Megatron-LM, a difference is refused unless the run says which to use:
``--override-opt_param-scheduler`` (this run's flags, in the scheduler and in every
param group; the iteration count comes from the checkpoint) or
``--use-checkpoint-opt_param-scheduler`` (the checkpoint's, in both).

The loaders call ``align_saved_groups`` before megatron loads an optimizer's state
(megatron-core 0.19 pairs the saved param groups with this run's by their learning
rates, among others: another ``--lr`` died on a ``KeyError``), then
``settle_schedule``.
"""
from __future__ import annotations

from typing import List, Optional

from megatron_sdp4bit.training.checkpoint.common import CheckpointError, adapter
from megatron_sdp4bit.training.console import log0

CHOICES = ("add --override-opt_param-scheduler to train with this run's values, or "
           "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")

# megatron's scheduler field -> (flag, whether it counts samples: shown in iterations)
_SCHEDULE_FLAGS = (
    ("max_lr", "--lr", False),
    ("min_lr", "--min-lr", False),
    ("lr_warmup_steps", "--lr-warmup-iters", True),
    ("lr_decay_steps", "--lr-decay-iters", True),
    ("lr_decay_style", "--lr-decay-style", False),
    ("start_wd", "--weight-decay", False),
)
_ADAM_FLAGS = (("--adam-beta1", lambda g: g["betas"][0]), ("--adam-beta2", lambda g: g["betas"][1]),
               ("--adam-eps", lambda g: g["eps"]))
# What this run's flags put into each param group (megatron's scheduler reads the
# learning rates from there; Adam its betas and epsilon). Not ``step`` (the count of
# steps done, which some optimizers keep there), nor the fields that name a group.
GROUP_SETTINGS = ("max_lr", "min_lr", "start_wd", "end_wd", "betas", "eps")
# What tells param groups apart whatever the flags (megatron-core 0.16's pairing keys).
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _shown(value, samples: bool, global_batch_size: Optional[int]):
    if samples and global_batch_size:
        return f"{value / global_batch_size:g}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def schedule_differences(saved: dict, current: dict, global_batch_size: Optional[int]) -> List[str]:
    """``--flag saved -> this run's`` for every schedule setting that differs."""
    changed = []
    for key, flag, samples in _SCHEDULE_FLAGS:
        if key in saved and saved[key] != current[key]:
            changed.append(f"{flag} {_shown(saved[key], samples, global_batch_size)} -> "
                           f"{_shown(current[key], samples, global_batch_size)}")
    # The weight decay's increment only matters when it is not constant.
    styles = (saved.get("wd_incr_style", "constant"), current["wd_incr_style"])
    if styles != ("constant", "constant") and (saved.get("wd_incr_steps") != current["wd_incr_steps"]
                                               or styles[0] != styles[1]):
        changed.append(f"weight-decay increment {saved.get('wd_incr_style')} over "
                       f"{_shown(saved.get('wd_incr_steps'), True, global_batch_size)} iterations -> "
                       f"{current['wd_incr_style']} over "
                       f"{_shown(current['wd_incr_steps'], True, global_batch_size)}")
    return changed


def _mode(scheduler) -> str:
    if scheduler.override_opt_param_scheduler:
        return "override"
    return "checkpoint" if scheduler.use_checkpoint_opt_param_scheduler else "ask"


def _which(mode: str) -> str:
    return ("this run's flags (--override-opt_param-scheduler)" if mode == "override" else
            "the checkpoint's values (--use-checkpoint-opt_param-scheduler)")


def group_settings(optimizer) -> List[dict]:
    """What this run's flags set in each of the optimizer's param groups (``GROUP_SETTINGS``),
    taken before a checkpoint's optimizer state replaces them."""
    return [{key: group[key] for key in GROUP_SETTINGS if key in group} for group in optimizer.param_groups]


def _counterpart(saved_groups: List[dict], group: dict, position: int) -> dict:
    """The saved param group of ``group``: the one of the same identity, else by position."""
    identity = [group.get(key) for key in _GROUP_IDENTITY]
    alike = [saved for saved in saved_groups if [saved.get(key) for key in _GROUP_IDENTITY] == identity]
    return alike[0] if len(alike) == 1 else saved_groups[position]


def align_saved_groups(sub_optimizers: list, states: list) -> List[dict]:
    """Before megatron loads the sub-optimizers' ``states``: put this run's settings
    (``GROUP_SETTINGS``) into the saved param groups, so that megatron pairs them with
    this run's whatever the flags, and return the saved settings, one dict per param
    group of the (chained) optimizer, for ``settle_schedule`` to keep or replace."""
    saved_settings = []
    for opt, state in zip(sub_optimizers, states):
        saved_groups = adapter().saved_param_groups(state)
        for position, group in enumerate(opt.param_groups):
            saved = _counterpart(saved_groups, group, position)
            saved_settings.append({key: saved[key] for key in GROUP_SETTINGS if key in saved})
            saved.update({key: group[key] for key in GROUP_SETTINGS if key in group})
    return saved_settings


def _adam_differences(saved: List[dict], asked: List[dict]) -> List[str]:
    if not saved or not asked or "betas" not in asked[0] or "betas" not in saved[0]:
        return []
    read = lambda groups: {flag: value(groups[0]) for flag, value in _ADAM_FLAGS}  # noqa: E731
    then, now = read(saved), read(asked)
    return [f"{flag} {then[flag]:g} -> {now[flag]:g}" for flag in now if then[flag] != now[flag]]


def _refuse(directory: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {directory} was saved with {what}, which loading it would silently "
                           f"keep: resume with the checkpoint's values, {CHOICES}")


def settle_schedule(state: dict, directory: str, optimizer, scheduler, asked: List[dict], saved: List[dict],
                    global_batch_size: Optional[int]) -> None:
    """After the optimizer's state was loaded: load the scheduler's state and keep the
    checkpoint's settings, put this run's back (in the scheduler and in every param
    group), or refuse, as the module docstring says; one line says which values differ
    and which were chosen. ``asked``: the ``group_settings`` taken before the
    optimizer's state was loaded; ``saved``: the checkpoint's (``align_saved_groups``)."""
    mode = _mode(scheduler)
    schedule = schedule_differences(state["scheduler"], scheduler.state_dict(), global_batch_size)
    adam = _adam_differences(saved, asked)
    if mode == "ask" and schedule:
        raise _refuse(directory, f"another learning-rate schedule ({', '.join(schedule)})")
    if mode == "ask" and adam:
        raise _refuse(directory, f"other Adam settings ({', '.join(adam)})")
    for group, settings in zip(optimizer.param_groups, asked if mode == "override" else saved):
        group.update(settings)
    # megatron's scheduler asserts every value equal unless told which to use; where
    # neither flag was given, everything that matters was found equal above.
    taking_checkpoint = scheduler.use_checkpoint_opt_param_scheduler
    scheduler.use_checkpoint_opt_param_scheduler = mode != "override"
    try:
        scheduler.load_state_dict(state["scheduler"])
    finally:
        scheduler.use_checkpoint_opt_param_scheduler = taking_checkpoint
    # Its load sets the param groups' learning rate and weight decay before it takes
    # the weight decay's values: once more, with the values chosen, for the first step.
    scheduler.step(0)
    if schedule:
        log0(f"learning-rate schedule: {', '.join(schedule)}; training continues with {_which(mode)}")
    if adam:
        log0(f"Adam: {', '.join(adam)}; training continues with {_which(mode)}")
