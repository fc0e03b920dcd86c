"""Flags whose values a checkpoint holds too: the learning-rate schedule and Adam's
hyper-parameters.

Loading megatron-core's scheduler state replaces this run's ``--lr``, ``--min-lr``,
warm-up, ``--lr-decay-iters``, decay style and weight decay by the checkpoint's
(its default), and loading the optimizer's state replaces ``--adam-beta1/2`` and
``--adam-eps``: a resume that asks for another schedule (extending a run with a
longer ``--train-iters``) would silently train at the old one. As in Megatron-LM, a
difference is refused unless the run says which to use:
``--override-opt_param-scheduler`` (this run's flags; the iteration count comes from
the checkpoint) or ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's).
The same two flags decide Adam's hyper-parameters.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional

from megatron_sdp4bit.training.checkpoint.common import CheckpointError
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


@contextmanager
def _taking_checkpoint_values(scheduler):
    """megatron's scheduler asserts every value equal unless told which to use; the
    settings that matter were compared already, so it may take the checkpoint's."""
    saved = scheduler.use_checkpoint_opt_param_scheduler
    scheduler.use_checkpoint_opt_param_scheduler = True
    try:
        yield
    finally:
        scheduler.use_checkpoint_opt_param_scheduler = saved


def load_schedule(scheduler, saved: dict, directory: str, global_batch_size: Optional[int]) -> None:
    """Load the checkpoint's schedule state: refused on a difference unless one of the
    two flags says which values to use (then one line says what was chosen)."""
    mode = _mode(scheduler)
    changed = schedule_differences(saved, scheduler.state_dict(), global_batch_size)
    if changed and mode == "ask":
        raise CheckpointError(
            f"checkpoint {directory} was saved with another learning-rate schedule ({', '.join(changed)}), "
            f"which loading it would silently keep: resume with the checkpoint's values, {CHOICES}")
    if changed:
        which = "this run's flags (--override-opt_param-scheduler)" if mode == "override" else \
            "the checkpoint's values (--use-checkpoint-opt_param-scheduler)"
        log0(f"learning-rate schedule: {', '.join(changed)}; training continues with {which}")
    if mode == "ask":
        with _taking_checkpoint_values(scheduler):
            scheduler.load_state_dict(saved)
    else:
        scheduler.load_state_dict(saved)


def adam_settings(optimizer) -> Dict[str, float]:
    """This optimizer's Adam hyper-parameters, by flag (the same in every param group)."""
    group = optimizer.param_groups[0]
    if "betas" not in group:  # not Adam
        return {}
    return {flag: read(group) for flag, read in _ADAM_FLAGS}


def settle_adam_settings(optimizer, asked: Dict[str, float], scheduler, directory: str) -> None:
    """After the optimizer's state was loaded (its param groups are the checkpoint's):
    keep them, put this run's back, or refuse, by the same rule as the schedule."""
    loaded = adam_settings(optimizer)
    changed = [f"{flag} {loaded[flag]:g} -> {asked[flag]:g}" for flag in asked if loaded.get(flag) != asked[flag]]
    if not changed:
        return
    mode = _mode(scheduler)
    if mode == "ask":
        raise CheckpointError(
            f"checkpoint {directory} was saved with other Adam settings ({', '.join(changed)}), which "
            f"loading it would silently keep: resume with the checkpoint's values, {CHOICES}")
    if mode == "override":
        for group in optimizer.param_groups:
            group["betas"] = (asked["--adam-beta1"], asked["--adam-beta2"])
            group["eps"] = asked["--adam-eps"]
    which = "this run's flags (--override-opt_param-scheduler)" if mode == "override" else \
        "the checkpoint's values (--use-checkpoint-opt_param-scheduler)"
    log0(f"Adam: {', '.join(changed)}; training continues with {which}")


def load_schedule_and_settle(state: dict, directory: str, optimizer, scheduler, asked: dict,
                             global_batch_size: Optional[int]) -> None:
    """The scheduler's state, and Adam's hyper-parameters the optimizer's state brought
    along, kept, replaced or refused by ``--override-opt_param-scheduler`` /
    ``--use-checkpoint-opt_param-scheduler`` (``overrides``)."""
    load_schedule(scheduler, state["scheduler"], directory, global_batch_size)
    settle_adam_settings(optimizer, asked, scheduler, directory)
