"""What --load and --save name, and what a resume does with it (issue 18 item 2 and beyond).

One forked world of 2 gloo ranks trains 4 steps saving at 2 and 4, then runs
each case on a copy of that folder: --load naming one checkpoint (the latest,
or an older one), a folder whose tracker file is gone, a --load that names
nothing, and a --save that already holds another run's checkpoints. Every case
either resumes what was named (the same losses as the first run, bit for bit)
or is refused on every rank in one line, before anything trains, with the
checkpoints left as they were.
"""
from __future__ import annotations

import os
import shutil

import pytest

from driver_runs import TINY_GPT, captured_run, driver_world, train_log
from megatron_sdp4bit.training.checkpoint import LATEST, CheckpointError
from megatron_sdp4bit.training.setup import NothingToTrain

TINY = TINY_GPT + ["--lr-decay-iters", "8", "--bf16",
                   "--sdp4bit", "--sdp4bit-ranks-per-node", "1"]


def _copies(root, names):
    """Copies of the first run's checkpoint folder, made by rank 0 while the others wait."""
    import torch

    if torch.distributed.get_rank() == 0:
        for name in names:
            shutil.copytree(os.path.join(root, "ck"), os.path.join(root, name))
        os.remove(os.path.join(root, "no_tracker", LATEST))
    torch.distributed.barrier()


def _world(rank, world_size, root):
    def go(name, flags):
        return captured_run(TINY + ["--run-dir", os.path.join(root, name)] + flags,
                            errors=(CheckpointError, NothingToTrain), named=True)

    at = lambda folder, *more: os.path.join(root, folder, *more)  # noqa: E731
    out = {"train": go("train", ["--train-iters", "4", "--save", at("ck"), "--save-interval", "2"])}
    _copies(root, ["pinned_latest", "pinned_older", "no_tracker", "other_run"])
    out["pinned_latest"] = go("pinned_latest", ["--train-iters", "6", "--load", at("pinned_latest", "iter_0000004"),
                                                "--save", at("pinned_latest")])
    out["pinned_older_saving"] = go("pinned_older_saving", [
        "--train-iters", "6", "--load", at("pinned_older", "iter_0000002"), "--save", at("pinned_older")])
    out["pinned_older"] = go("pinned_older", ["--train-iters", "4", "--load", at("pinned_older", "iter_0000002")])
    out["no_tracker"] = go("no_tracker", ["--train-iters", "6", "--load", at("no_tracker"),
                                          "--save", at("no_tracker")])
    out["nothing"] = go("nothing", ["--train-iters", "2", "--load", at("typo")])
    out["other_run"] = go("other_run", ["--train-iters", "2", "--save", at("other_run")])
    out["first_start"] = go("first_start", ["--train-iters", "1", "--load", at("new"), "--save", at("new")])
    out["done"] = go("done", ["--train-iters", "4", "--load", at("ck"), "--save", at("ck")])
    out["past"] = go("past", ["--train-iters", "3", "--load", at("ck")])
    out["other_seed"] = go("other_seed", ["--train-iters", "6", "--load", at("ck"), "--seed", "7"])
    out["save_into_one"] = go("save_into_one", ["--train-iters", "6", "--load", at("ck"),
                                                "--save", at("ck", "iter_0000004")])
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return driver_world(tmp_path_factory, "paths", _world, 2, timeout_s=600)


def _latest(root, folder):
    return open(os.path.join(root, folder, LATEST)).read().strip()


def _listing(folder):
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))  # not the save lock


def _trained_nothing(result):
    return "resumed" not in result["stdout"] and "iter " not in result["stdout"]


def _refused_on_every_rank(results, case: str, line: str) -> None:
    """The module's promise for a refusal: ``line`` on every rank, before anything trains."""
    for result in results:
        assert result[case]["error"] == line
        assert _trained_nothing(result[case])


def test_load_of_the_latest_checkpoint_itself_resumes_it(world):
    """Before: 'no checkpoint there, starting from scratch', and the tracker went 4 -> 2."""
    root, results = world
    result = results[0]["pinned_latest"]
    assert result["error"] is None, result["error"]
    assert f"resumed from {os.path.join(root, 'pinned_latest', 'iter_0000004')} at iteration 4" in result["stdout"]
    assert sorted(train_log(root, "pinned_latest")) == [5, 6]
    assert _latest(root, "pinned_latest") == "6"


def test_an_older_checkpoint_resumes_but_does_not_overwrite_newer_ones(world):
    root, results = world
    older = os.path.join(root, "pinned_older")
    assert _latest(root, "pinned_older") == "4"  # the newer checkpoint stays the latest
    _refused_on_every_rank(results, "pinned_older_saving", (
        f"CheckpointError: --save {older} holds checkpoints newer than the one this run resumes from (iteration 2): "
        f"iteration(s) [4]; saving there would replace them. Resume from the newest with --load "
        f"{os.path.join(older, 'iter_0000004')}, or choose another --save"))
    resumed, first = train_log(root, "pinned_older"), train_log(root, "train")
    assert results[0]["pinned_older"]["error"] is None
    # without --save, what it trains is lost at its end: said once, at the start
    assert (f"--load {os.path.join(older, 'iter_0000002')} without --save: nothing this run trains after iteration "
            "2 is saved; add --save DIR to keep it") in results[0]["pinned_older"]["stdout"]
    assert sorted(resumed) == [3, 4] and [resumed[3], resumed[4]] == [first[3], first[4]]


def test_a_folder_without_its_tracker_file_resumes_from_its_newest_complete_checkpoint(world):
    """Before: 'no checkpoint there, starting from scratch'; a later --load resumed that."""
    root, results = world
    result = results[0]["no_tracker"]
    assert result["error"] is None, result["error"]
    assert f"no {LATEST} there; resuming from its newest complete checkpoint" in result["stdout"]
    assert "at iteration 4" in result["stdout"]
    assert sorted(train_log(root, "no_tracker")) == [5, 6] and _latest(root, "no_tracker") == "6"


def test_a_load_that_names_nothing_is_refused(world):
    root, results = world
    _refused_on_every_rank(results, "nothing", (
        f"CheckpointError: --load {os.path.join(root, 'typo')} does not exist: pass the folder --save wrote, or drop "
        "--load to start from scratch"))


def test_a_save_folder_of_another_run_is_refused(world):
    root, results = world
    other = os.path.join(root, "other_run")
    _refused_on_every_rank(results, "other_run", (
        f"CheckpointError: --save {other} already holds checkpoints (up to iteration 4) and this run starts from "
        f"scratch: saving there would replace them. Resume them with --load {other}, or choose an "
        "empty --save folder"))
    assert _latest(root, "other_run") == "4" and _listing(other) == sorted([LATEST, "iter_0000002", "iter_0000004"])


def test_load_and_save_of_one_new_folder_start_from_scratch(world):
    """The command that starts a job and resumes it after each interruption."""
    root, results = world
    result = results[0]["first_start"]
    assert result["error"] is None, result["error"]
    assert "no checkpoint there yet, starting from scratch (it is also --save)" in result["stdout"]
    assert _latest(root, "new") == "1"


def test_a_checkpoint_at_train_iters_is_done_and_one_past_it_is_refused(world):
    """Before: nothing trained, the same iteration saved again (over the checkpoint)
    and a summary of NaN losses, exit 0; past --train-iters the same, silently."""
    root, results = world
    ck = os.path.join(root, "ck")
    _refused_on_every_rank(results, "done", (
        f"NothingToTrain: --load {ck} is at iteration 4, which is --train-iters: nothing to train (raise "
        "--train-iters to train on)"))
    _refused_on_every_rank(results, "past", (
        f"CheckpointError: --load {ck} is at iteration 4, past --train-iters 3: raise --train-iters to "
        f"train on, or --load one of its earlier checkpoints ({os.path.join(ck, 'iter_NNNNNNN')})"))
    assert _latest(root, "ck") == "4"


def test_a_resume_with_another_seed_is_refused(world):
    """The random states come from the checkpoint, the data order from --seed: a resume
    with another one would read other samples than the run it continues (the rule of
    every data flag: test_resume_data.py)."""
    root, results = world
    _refused_on_every_rank(results, "other_seed", (
        f"CheckpointError: checkpoint {os.path.join(root, 'ck', 'iter_0000004')} was saved with --seed "
        "1234 (this run: 7): this run would train on other samples than the run it continues; resume with "
        "--seed 1234"))


def test_a_save_folder_that_is_one_checkpoint_is_refused(world):
    root, results = world
    one = os.path.join(root, "ck", "iter_0000004")
    _refused_on_every_rank(results, "save_into_one", (
        f"CheckpointError: --save {one} is one checkpoint (it holds manifest.json or rank files), not a "
        f"folder of them: pass its folder, --save {os.path.join(root, 'ck')}"))
