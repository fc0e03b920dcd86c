"""``make train ARGS=...``: the recipe's hidden flags follow ARGS or are named as the
recipe's, and a refusal is the last line printed (issue 28, item 9).

Before: ``make train ARGS="--train-iters 10"`` was refused for the recipe's
``--lr-warmup-iters 10`` (which ARGS never wrote), in a line about 55 lines of
torchrun output above the end.
"""
from __future__ import annotations

import json
import sys

import pytest

from megatron_sdp4bit import demo, recipes


def _warmup(flags):
    """The warm-up iterations the driver takes from ``flags``."""
    from megatron_sdp4bit.training.arguments import parse_args

    args = parse_args(flags)
    return args.lr_warmup_iters or int(args.lr_warmup_fraction * args.lr_decay_iters)


def test_without_args_the_flags_are_those_of_the_shipped_reference():
    with open(demo.REFERENCE) as f:
        reference = json.load(f)
    flags = demo.command_flags([])
    assert flags == demo.DEFAULT_FLAGS
    assert flags[:len(reference["recipe_flags"])] == reference["recipe_flags"]
    assert _warmup(flags) == 10 and demo.refusal(flags, []) is None


@pytest.mark.parametrize("extra, warmup", [
    (["--train-iters", "10"], 0), (["--train-iters", "50"], 2), (["--train-iters=400"], 20),
    (["--lr-decay-iters", "100"], 5), (["--train-iters", "10", "--lr-warmup-iters", "3"], 3),
    (["--train-iters", "10", "--lr-warmup-fraction", "0.2"], 2),
])
def test_the_recipes_warmup_follows_the_iterations_args_set(extra, warmup):
    flags = demo.command_flags(extra)
    assert _warmup(flags) == warmup and flags[-len(extra):] == extra
    assert demo.refusal(flags, extra) is None


def test_a_refusal_caused_by_a_hidden_flag_names_it_as_the_recipes_and_the_fix_works():
    extra = ["--micro-batch-size", "3"]
    line = demo.refusal(demo.command_flags(extra), extra)
    assert line == ("make train: error: --global-batch-size 16 is not divisible by --micro-batch-size 3 x "
                    "data-parallel size 4 = 12 (--global-batch-size 16: make train's recipe, "
                    "megatron_sdp4bit/recipes.py; set it in ARGS to change it)")
    fixed = extra + ["--global-batch-size", "24"]
    assert demo.refusal(demo.command_flags(fixed), fixed) is None
    own = ["--train-iters", "10", "--lr-warmup-iters", "10"]  # the user's own flags: no recipe note
    assert "recipe" not in demo.refusal(demo.command_flags(own), own)


def test_a_refused_args_is_the_last_line_and_nothing_is_launched(monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_job", lambda cmd: pytest.fail("launched"))
    assert demo.main(["--micro-batch-size", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [demo.refusal(demo.command_flags(["--micro-batch-size", "3"]),
                                                      ["--micro-batch-size", "3"])]


def test_a_failed_job_ends_with_the_drivers_line(capsys):
    job = ("import sys; print('sdp4bit-pretrain: error: --load ck2 does not exist', file=sys.stderr); "
           "print('torchrun: ChildFailedError ... a long report', file=sys.stderr); sys.exit(1)")
    assert demo.run_job([sys.executable, "-c", job]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "make train: the job failed (exit 1): sdp4bit-pretrain: error: --load ck2 does not exist"
    assert demo.run_job([sys.executable, "-c", "pass"]) == 0


def test_hidden_flags_are_the_recipes_flags_args_do_not_set():
    flags = recipes.MAKE_TRAIN.flags()
    hidden = recipes.hidden_flags(flags, ["--lr", "1e-4", "--train-iters=5"])
    assert "--lr" not in hidden and "--train-iters" not in hidden
    assert hidden["--lr-warmup-iters"] == "10" and hidden["--use-distributed-optimizer"] == ""


def test_a_ctrl_c_leaves_the_job_to_stop_on_its_own_and_its_code_is_returned(capsys):
    """A Ctrl-C goes to the job too (one process group); make train keeps passing its
    output on and ends with its code (subprocess.call, before, SIGKILLed torchrun, which
    then could not stop its ranks, and raised a traceback)."""
    import os
    import signal
    import threading

    job = ("import sys, time; print('started', file=sys.stderr, flush=True); time.sleep(3); "
           "print('sdp4bit-pretrain: stopped: SIGINT received', file=sys.stderr); sys.exit(130)")
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    assert demo.run_job([sys.executable, "-c", job]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == \
        "make train: the job failed (exit 130): sdp4bit-pretrain: stopped: SIGINT received"


def test_an_unwritable_cache_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Before: make train's own corpus preparation raised the OSError with a traceback."""
    (tmp_path / ".cache").write_text("not a folder")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SDP4BIT_CACHE", raising=False)
    monkeypatch.setattr(demo, "run_job", lambda cmd: pytest.fail("launched"))
    assert demo.main([]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"make train: error: cannot write {tmp_path}/.cache/megatron_sdp4bit (")
    assert "set SDP4BIT_CACHE to a writable folder" in last


def test_the_corpus_prepared_is_the_one_the_run_reads(monkeypatch, capsys):
    """Before: the whole embedded corpus was built (a minute the first time) even for
    ARGS with --data-path or --default-corpus-mb."""
    from megatron_sdp4bit.data import corpus

    asked = []
    monkeypatch.setattr(corpus, "prepare_default_corpus", lambda max_mb=None: asked.append(max_mb) or "x/p")
    monkeypatch.setattr(corpus, "default_corpus_meta", lambda prefix: {"files": 1, "bytes": 1, "tokens": 1})
    monkeypatch.setattr(demo, "run_job", lambda cmd: 1)
    assert demo.main(["--data-path", "d/p_text_document", "--tokenizer-type", "GPT2BPETokenizer"]) == 1
    assert demo.main(["--default-corpus-mb", "8"]) == 1
    assert asked == [8.0]
