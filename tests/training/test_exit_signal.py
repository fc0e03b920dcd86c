"""The exit-signal handler on forked ranks: save, then stop (issue 18 item 6, issue 28 item 3).

Before, SIGTERM ended the job with nothing saved since the last interval. Now the
signal only sets a flag; after every iteration the ranks agree whether any has
it, save and stop, with exit code 128 + the signal's number.

In one forked world of 2 gloo ranks: the signal reaches rank 1 alone after
iteration 3 (every rank stops there, saved); it reaches rank 0 after 2 and rank 1
after 4 (every rank stops after 2: the first one counts); the resumed run
continues the uninterrupted run's losses bit for bit. Without the handler flag but
with ``--save``, SIGINT then SIGTERM (what torchrun sends on a second Ctrl-C) stop
the run once, named after the first; a signal before an evaluation cuts it short.
Real torchrun jobs: test_launcher_signals.py.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal

import pytest

from driver_runs import TINY_GPT, driver_world, train_log
from megatron_sdp4bit.training.checkpoint import LATEST, check_files, read_manifest
from megatron_sdp4bit.training.metrics import read_metrics
from megatron_sdp4bit.training.signals import StoppedBySignal, StoppedDuringSetUp

TINY = TINY_GPT + ["--lr-decay-iters", "1000", "--bf16",
                   "--sdp4bit", "--sdp4bit-ranks-per-node", "1"]
HANDLER = ["--exit-signal-handler"]


def _signal_at(when: dict, signums=(signal.SIGTERM,)):
    """An on_step callback: ``signums`` to this very process, one after the other,
    after the given iteration (``{rank: iteration}``)."""
    import torch

    def send(run):
        if when.get(torch.distributed.get_rank()) == run.iteration:
            for signum in signums:
                os.kill(os.getpid(), signum)

    return send


def _world(rank, world_size, root):
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.run import TrainingRun
    from megatron_sdp4bit.training.setup import set_up

    def go(name, flags, when=None, signums=(signal.SIGTERM,)):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            run = TrainingRun(set_up(parse_args(TINY + ["--run-dir", os.path.join(root, name)] + flags)),
                              on_step=_signal_at(when or {}, signums))
            try:
                run.train()
                stopped = None
            except StoppedBySignal as exc:
                stopped = (str(exc), exc.exit_code)
        return {"stdout": text.getvalue(), "stopped": stopped, "iteration": run.iteration}

    at = lambda name: os.path.join(root, name)  # noqa: E731

    def during_set_up(name, flags):  # the driver's run, SIGTERM as its set-up begins
        import megatron_sdp4bit.pretrain as driver

        real = driver.set_up

        def signalled(args):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(args)

        driver.set_up = signalled
        try:
            driver.run(parse_args(TINY + ["--run-dir", os.path.join(root, name)] + flags))
            return None
        except StoppedDuringSetUp as exc:
            return str(exc), exc.exit_code
        finally:
            driver.set_up = real

    def nohup(name, flags, when, signums):  # SIGHUP ignored from the start, as nohup runs a process
        previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            return go(name, flags, when, signums)
        finally:
            signal.signal(signal.SIGHUP, previous)

    return {
        "straight": go("straight", ["--train-iters", "5"]),
        "one_rank": go("one_rank", HANDLER + ["--train-iters", "5", "--save", at("ck")], {1: 3}),
        "resumed": go("resumed", ["--train-iters", "5", "--load", at("ck")]),
        "different_steps": go("different_steps", HANDLER + ["--train-iters", "5", "--save", at("ck2")],
                              {0: 2, 1: 4}),
        "no_save": go("no_save", HANDLER + ["--train-iters", "5"], {0: 1}),
        "at_the_end": go("at_the_end", HANDLER + ["--train-iters", "2", "--save", at("ck3")], {1: 2}),
        "two_signals": go("two_signals", ["--train-iters", "5", "--save", at("ck4")], {0: 2},
                          (signal.SIGINT, signal.SIGTERM)),
        "during_set_up": during_set_up("during_set_up", ["--train-iters", "3", "--save", at("ck8")]),
        "nohup": nohup("nohup", ["--train-iters", "3", "--save", at("ck7")], {0: 2}, (signal.SIGHUP,)),
        "at_a_save": go("at_a_save", ["--train-iters", "5", "--save", at("ck6"), "--save-interval", "2"], {1: 2}),
        "before_evaluation": go("before_evaluation", ["--train-iters", "5", "--save", at("ck5"),
                                                      "--eval-interval", "2", "--eval-iters", "200"], {1: 2}),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return driver_world(tmp_path_factory, "signals", _world, 2, timeout_s=600)


def test_a_signal_on_one_rank_saves_and_stops_every_rank_at_the_same_step(world):
    root, results = world
    ck = os.path.join(root, "ck")
    for result in results:
        assert result["one_rank"]["iteration"] == 3
        assert result["one_rank"]["stopped"] == (
            f"SIGTERM received: stopped after iteration 3, its checkpoint is saved in {ck}; resume with "
            f"--load {ck}", 143)
    assert open(os.path.join(ck, LATEST)).read().strip() == "3"
    assert check_files(os.path.join(ck, "iter_0000003"), read_manifest(os.path.join(ck, "iter_0000003"))) == []


def test_the_resumed_run_continues_the_uninterrupted_curve(world):
    root, results = world
    straight, stopped, resumed = (train_log(root, n) for n in ("straight", "one_rank", "resumed"))
    assert sorted(stopped) == [1, 2, 3] and sorted(resumed) == [4, 5]
    assert {**stopped, **resumed} == straight
    assert f"resumed from {os.path.join(root, 'ck')} at iteration 3" in results[0]["resumed"]["stdout"]


def test_the_first_rank_to_get_the_signal_decides_the_step(world):
    root, results = world
    for result in results:
        assert result["different_steps"]["iteration"] == 2
    assert open(os.path.join(root, "ck2", LATEST)).read().strip() == "2"


def test_without_save_the_run_says_nothing_was_saved(world):
    _, results = world
    for result in results:
        assert result["no_save"]["stopped"] == (
            "SIGTERM received: stopped after iteration 1, nothing saved (no --save)", 143)


def test_a_signal_after_the_last_iteration_lets_the_run_complete(world):
    """The final checkpoint is written with the handler still in place: exit 0, done."""
    root, results = world
    for result in results:
        assert result["at_the_end"]["stopped"] is None and result["at_the_end"]["iteration"] == 2
    assert open(os.path.join(root, "ck3", LATEST)).read().strip() == "2"


def test_with_save_and_no_flag_sigint_then_sigterm_stop_once_named_after_the_first(world):
    root, results = world
    ck = os.path.join(root, "ck4")
    for result in results:
        assert result["two_signals"]["stopped"] == (
            f"SIGINT received: stopped after iteration 2, its checkpoint is saved in {ck}; resume with "
            f"--load {ck}", 130)
    assert open(os.path.join(ck, LATEST)).read().strip() == "2"


def test_a_signal_before_an_evaluation_cuts_it_short_and_saves(world):
    """200 evaluation batches would outlast a launcher's grace period on a large model."""
    root, results = world
    for result in results:
        assert result["before_evaluation"]["iteration"] == 2
        assert result["before_evaluation"]["stopped"][1] == 143
    assert "iteration 2: evaluation cut short by the stop (not logged)" in results[0]["before_evaluation"]["stdout"]
    metrics = read_metrics(os.path.join(root, "before_evaluation", "metrics.jsonl"))
    assert [r for r in metrics if r["kind"] == "valid"] == []
    assert open(os.path.join(root, "ck5", LATEST)).read().strip() == "2"


@pytest.mark.parametrize("flags, config, on", [
    ([], None, False),
    (["--save", "ck"], None, True),
    (["--save", "ck", "--no-exit-signal-handler"], None, False),
    (["--exit-signal-handler"], None, True),
    (["--save", "ck"], "exit_signal_handler: false\n", False),
])
def test_the_handler_is_on_with_save_unless_turned_off(tmp_path, flags, config, on):
    from megatron_sdp4bit.training.arguments import parse_args

    if config is not None:
        (tmp_path / "run.yaml").write_text(config)
        flags = flags + ["--config", str(tmp_path / "run.yaml")]
    assert parse_args(TINY + ["--train-iters", "5"] + flags).exit_signal_handler is on


def test_a_signal_before_a_periodic_save_stops_after_it_without_a_second_save(world):
    """The handler only sets a flag: a save under way completes, and the stop that
    follows at the step boundary finds it done."""
    root, results = world
    for result in results:
        assert result["at_a_save"]["stopped"][1] == 143 and result["at_a_save"]["iteration"] == 2
    assert results[0]["at_a_save"]["stdout"].count("saved checkpoint at iteration 2") == 1
    assert [name for name in os.listdir(os.path.join(root, "ck6")) if name.startswith("iter_")] == ["iter_0000002"]


def test_a_hang_up_that_nohup_ignores_stays_ignored_without_a_launcher(world):
    """``nohup python -m megatron_sdp4bit.pretrain ...`` keeps running when its terminal
    closes (under torchrun a SIGHUP comes from torchrun only, to stop the rank)."""
    _, results = world
    for result in results:
        assert result["nohup"]["stopped"] is None and result["nohup"]["iteration"] == 3


def test_a_signal_during_set_up_stops_it_at_once_in_one_line(world):
    """Nothing is trained yet: no save, no folder written; before, SIGTERM ended the
    ranks without a word (SIGINT: a KeyboardInterrupt traceback on every rank)."""
    root, results = world
    for result in results:
        assert result["during_set_up"] == (
            "SIGTERM received during set-up: stopped before training, nothing saved", 143)
    assert not os.path.exists(os.path.join(root, "ck8", LATEST))
