"""The driver's log / evaluate / save / stop policy, on iterations alone (no model, no ranks)."""
from __future__ import annotations

from types import SimpleNamespace

from megatron_sdp4bit.training.policy import StepPolicy


def _policy(**overrides) -> StepPolicy:
    args = dict(train_iters=20, log_interval=5, eval_interval=8, eval_iters=1, save_interval=6, save="ckpt",
                max_consecutive_skipped_iters=3)
    args.update(overrides)
    return StepPolicy.from_args(SimpleNamespace(**args))


def _when(policy, field, streaks=None):
    streaks = streaks or {}
    return [i for i in range(1, policy.train_iters + 1)
            if getattr(policy.after_step(i, streaks.get(i, 0)), field)]


def test_logs_evaluates_and_saves_on_their_intervals_and_at_the_last_iteration():
    policy = _policy()
    assert _when(policy, "log") == [5, 10, 15, 20]
    assert _when(policy, "evaluate") == [8, 16, 20]
    assert _when(policy, "save") == [6, 12, 18]
    assert not policy.saves_at_end(18) and policy.saves_at_end(20)  # 20 is not a multiple of 6
    assert not _policy(save_interval=5).saves_at_end(20)


def test_without_save_nothing_is_saved():
    policy = _policy(save=None, save_interval=None)
    assert _when(policy, "save") == [] and not policy.saves_at_end(20)
    assert _policy(save_interval=None).saves_at_end(20)  # --save alone: once, at the end


def test_a_streak_of_skipped_steps_withholds_saves_and_stops_at_the_limit():
    policy = _policy()
    streaks = {11: 1, 12: 2, 13: 3}
    assert _when(policy, "save", streaks) == [6, 18]
    assert _when(policy, "save_withheld", streaks) == [12]
    assert _when(policy, "stop", streaks) == [13]
    assert 13 in _when(policy, "log", streaks)  # the stopping window is logged first


def test_eval_iters_0_never_evaluates():
    """Megatron-LM's meaning (docs/megatron.md uses it): evaluation off, training and
    saving as usual."""
    policy = _policy(eval_iters=0)
    assert _when(policy, "evaluate") == []
    assert _when(policy, "save") == [6, 12, 18] and policy.saves_at_end(20)
