"""A resume that asks for another learning-rate schedule or other Adam settings (issue 18
item 3, issue 28 item 2).

megatron-core's scheduler keeps the checkpoint's schedule by default, and the
optimizer's state brings Adam's betas and epsilon along: extending a 4-step run
to 8 steps with ``--lr-decay-iters 8`` trained every extra step at the old
schedule's minimum. As in Megatron-LM, a difference is now refused unless
``--override-opt_param-scheduler`` (this run's flags) or
``--use-checkpoint-opt_param-scheduler`` (the checkpoint's) says which to use.

``--override-opt_param-scheduler`` used to apply ``--lr-decay-iters`` only: megatron's
scheduler reads ``max_lr`` / ``min_lr`` from the optimizer's param groups, which the
checkpoint's optimizer state brought back, so ``--lr`` and ``--min-lr`` stayed the
checkpoint's; and ``--use-checkpoint-opt_param-scheduler`` trained its first step
with this run's ``--weight-decay``. Now every schedule flag takes effect, in the
scheduler and in every param group, with either flag.

One forked world of 2 gloo ranks: 4 steps with a schedule decaying over 4,
saved; a straight 8-step run decaying over 8 (the reference learning rates);
then the resumes.
"""
from __future__ import annotations

import os

import pytest

from driver_runs import TINY_GPT, captured_run, driver_world, train_log
from megatron_sdp4bit.training.arguments import ArgumentError, parse_args

TINY = TINY_GPT + ["--min-lr", "3e-4", "--bf16",
                   "--sdp4bit", "--sdp4bit-ranks-per-node", "1"]
LONGER = ["--train-iters", "8", "--lr-decay-iters", "8"]
OVERRIDE, KEEP = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"
EVERY_FLAG = ["--train-iters", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
              "--lr-decay-iters", "8", "--lr-decay-style", "linear", "--weight-decay", "0.05",
              "--adam-beta1", "0.8", "--adam-beta2", "0.99", "--adam-eps", "1e-6"]
"""Another value of every schedule and Adam flag than the checkpoint's."""


def _groups(run) -> list:
    """What the schedule and Adam set in each param group after a step (for the next)."""
    return [(g["lr"], g["weight_decay"], g["max_lr"], g["min_lr"], tuple(g["betas"]), g["eps"])
            for g in run.parts.optimizer.param_groups]


def _world(rank, world_size, root):
    def go(name, flags):
        """The run, Adam's betas and the param groups' settings at each of its steps."""
        betas, groups = [], []

        def on_step(run):
            betas.append(tuple(run.parts.optimizer.param_groups[0]["betas"]))
            groups.append(_groups(run))

        result = captured_run(TINY + ["--run-dir", os.path.join(root, name)] + flags, on_step=on_step)
        return dict(result, betas=betas, groups=groups)

    ck = os.path.join(root, "ck")
    load = ["--load", ck]
    return {
        "first": go("first", ["--train-iters", "4", "--lr-decay-iters", "4", "--save", ck]),
        "straight": go("straight", LONGER),
        "asked": go("asked", LONGER + load),
        "override": go("override", LONGER + load + [OVERRIDE]),
        "keep": go("keep", LONGER + load + [KEEP]),
        "same_schedule": go("same_schedule", ["--train-iters", "8", "--lr-decay-iters", "4"] + load),
        "adam": go("adam", ["--train-iters", "8", "--lr-decay-iters", "4", "--adam-beta2", "0.99"] + load),
        "adam_override": go("adam_override", ["--train-iters", "5", "--lr-decay-iters", "4",
                                              "--adam-beta2", "0.99", OVERRIDE] + load),
        "straight_every_flag": go("straight_every_flag", EVERY_FLAG),
        "override_every_flag": go("override_every_flag", EVERY_FLAG + load + [OVERRIDE]),
        "keep_every_flag": go("keep_every_flag", EVERY_FLAG + load + [KEEP]),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return driver_world(tmp_path_factory, "overrides", _world, 2, timeout_s=600)


def _refusal(root, what: str) -> str:
    """The line that refuses a resume whose flags differ from the checkpoint's in ``what``."""
    return (f"checkpoint {os.path.join(root, 'ck', 'iter_0000004')} was saved with {what}, which "
            "loading it would silently keep: resume with the checkpoint's values, add "
            "--override-opt_param-scheduler to train with this run's values, or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def test_another_schedule_is_refused_naming_both_flags(world):
    root, results = world
    for result in results:
        assert result["asked"]["error"] == _refusal(
            root, "another learning-rate schedule (--lr-decay-iters 4 -> 8)")
        assert "iter " not in result["asked"]["stdout"]


def test_override_trains_the_extra_steps_on_this_runs_schedule(world):
    """Before: every extra step at the old schedule's minimum learning rate."""
    root, results = world
    assert results[0]["override"]["error"] is None, results[0]["override"]["error"]
    assert "--lr-decay-iters 4 -> 8; training continues with this run's flags" in results[0]["override"]["stdout"]
    resumed, straight = train_log(root, "override", "lr"), train_log(root, "straight", "lr")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[i] for i in resumed] == [straight[i] for i in resumed]
    assert resumed[5] > 3e-4


def test_use_checkpoint_keeps_the_saved_schedule(world):
    root, results = world
    assert results[0]["keep"]["error"] is None, results[0]["keep"]["error"]
    assert "training continues with the checkpoint's values" in results[0]["keep"]["stdout"]
    lrs = train_log(root, "keep", "lr")
    assert sorted(lrs) == [5, 6, 7, 8]
    assert lrs == {i: pytest.approx(3e-4) for i in lrs}  # past the old decay: its minimum


def test_a_longer_run_on_the_same_schedule_needs_no_flag(world):
    root, results = world
    assert results[0]["same_schedule"]["error"] is None, results[0]["same_schedule"]["error"]
    assert sorted(train_log(root, "same_schedule", "lr")) == [5, 6, 7, 8]


def test_other_adam_settings_are_refused_or_overridden(world):
    root, results = world
    for result in results:
        assert result["adam"]["error"] == _refusal(root, "other Adam settings (--adam-beta2 0.95 -> 0.99)")
    assert results[0]["adam_override"]["error"] is None, results[0]["adam_override"]["error"]
    assert results[0]["adam_override"]["betas"] == [(0.9, 0.99)]
    assert results[0]["same_schedule"]["betas"][0] == (0.9, 0.95)


def test_the_two_flags_contradict_each_other():
    with pytest.raises(ArgumentError, match="--override-opt_param-scheduler and "
                                            "--use-checkpoint-opt_param-scheduler contradict"):
        parse_args(["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert parse_args(["--override-opt-param-scheduler"]).override_opt_param_scheduler


def test_override_applies_every_schedule_and_adam_flag(world):
    """Before: only --lr-decay-iters took effect; --lr and --min-lr stayed the
    checkpoint's (the param groups' max_lr / min_lr), so the resume trained at 3e-3
    decaying to 3e-4 where a straight run with its flags trains at 1e-3 to 1e-4."""
    root, results = world
    result = results[0]["override_every_flag"]
    assert result["error"] is None, result["error"]
    assert ("learning-rate schedule: --lr 0.003 -> 0.001, --min-lr 0.0003 -> 0.0001, --lr-warmup-iters 1 -> 2, "
            "--lr-decay-iters 4 -> 8, --lr-decay-style cosine -> linear, --weight-decay 0.1 -> 0.05; training "
            "continues with this run's flags") in result["stdout"]
    straight = results[0]["straight_every_flag"]
    for rank in results:  # each param group's lr, weight decay, max/min lr, betas, eps, step by step
        assert rank["override_every_flag"]["groups"] == rank["straight_every_flag"]["groups"][4:]
    lrs = train_log(root, "override_every_flag", "lr")
    assert lrs == {i: train_log(root, "straight_every_flag", "lr")[i] for i in (5, 6, 7, 8)}
    assert straight["groups"][-1][0][0] == pytest.approx(1e-4)


def test_use_checkpoint_keeps_every_saved_setting_from_the_first_step(world):
    """Every flag differs, the checkpoint's values are kept: the same run as a resume
    that asks for nothing else, loss for loss. Before: the first resumed step used this
    run's --weight-decay (megatron's scheduler sets it before it loads the saved one)."""
    root, results = world
    for rank in results:
        assert rank["keep_every_flag"]["error"] is None, rank["keep_every_flag"]["error"]
        assert rank["keep_every_flag"]["groups"] == rank["same_schedule"]["groups"]
    assert train_log(root, "keep_every_flag") == train_log(root, "same_schedule")


def test_saved_param_groups_are_paired_by_identity_and_given_this_runs_settings():
    """megatron-core 0.19 pairs a checkpoint's param groups with this run's by their
    max_lr / min_lr among others: a resume with another --lr died on megatron's
    KeyError (None, 0.001, 0.0001, ...) whichever flag was given (test_resume_overrides
    under MCORE=0.19.2). The saved groups get this run's settings before megatron loads
    them; the saved ones come back, in this run's group order, for the flags to decide."""
    from types import SimpleNamespace

    from megatron_sdp4bit.training.checkpoint.overrides import align_saved_groups

    def group(wd_mult, lr, min_lr, beta2):
        return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
                "max_lr": lr, "min_lr": min_lr, "betas": (0.9, beta2), "eps": 1e-8, "params": [0]}

    saved = {"state": {}, "param_groups": [group(0.0, 3e-3, 3e-4, 0.95), group(1.0, 3e-3, 3e-4, 0.95)]}  # FP32's form
    ours = SimpleNamespace(param_groups=[group(1.0, 1e-3, 1e-4, 0.99), group(0.0, 1e-3, 1e-4, 0.99)])
    settings = align_saved_groups([ours], [saved])
    assert settings == [{"max_lr": 3e-3, "min_lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8}] * 2
    assert [(g["wd_mult"], g["max_lr"], g["min_lr"], g["betas"]) for g in saved["param_groups"]] == \
        [(0.0, 1e-3, 1e-4, (0.9, 0.99)), (1.0, 1e-3, 1e-4, (0.9, 0.99))]
