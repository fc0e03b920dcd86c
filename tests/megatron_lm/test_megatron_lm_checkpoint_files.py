"""Which saved SDP4Bit state each rank resumes from, and the log figures' wording.

``megatron_lm/checkpoint.py`` writes one file per rank beside Megatron-LM's checkpoint;
``resume_state.decide`` picks this rank's state for the layout of the resuming run, and
``resume_state.agree`` turns every rank's decision into the one outcome all act on.
Checked here on files the test writes (no megatron, no processes): the same layout
takes its own file; another data-parallel size keeps the step count, a saved rank's
streams and gives a new rank fresh ones; exact main shards or another model
parallelism for another size, and a missing, damaged or foreign rank file, are refused
with one line naming it (rank 0's file too: a checkpoint whose saved args asked for
quantization, or that has an ``sdp4bit/`` folder, is not one saved without the layer);
one rank's refusal is every rank's.
"""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron_sdp4bit.megatron_lm import checkpoint, reporting, resume_state
from megatron_sdp4bit.megatron_lm.resume_state import Refused, decide


def _layout(world, dp, rank, model_parallel=(1, 1, 1, 1)):
    return {"world_size": world, "rank": rank, "data_parallel_size": dp, "data_parallel_rank": rank % dp,
            "model_parallel": list(model_parallel)}


def _save(folder, world, dp, main_shards=False, model_parallel=(1, 1, 1, 1)):
    for rank in range(world):
        path = resume_state.rank_file(str(folder), rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"iteration": 7, "rng": {("cpu", 1234, rank, "grads"): torch.tensor([rank], dtype=torch.uint8)},
                 "main_shards": {(0, 0, 0): torch.full((4,), float(rank))} if main_shards else {}}
        torch.save({"layout": _layout(world, dp, rank, model_parallel), "state": state}, path)


def test_same_layout_takes_its_own_file(tmp_path):
    _save(tmp_path, world=4, dp=4, main_shards=True)
    state = decide(str(tmp_path), _layout(4, 4, 2), saved_with_layer=True)
    assert state["iteration"] == 7
    assert list(state["rng"]) == [("cpu", 1234, 2, "grads")]
    assert torch.equal(state["main_shards"][(0, 0, 0)], torch.full((4,), 2.0))


def test_another_data_parallel_size_keeps_the_step_count_and_saved_streams(tmp_path):
    _save(tmp_path, world=2, dp=2)
    kept = decide(str(tmp_path), _layout(4, 4, 1), saved_with_layer=True)
    new = decide(str(tmp_path), _layout(4, 4, 3), saved_with_layer=True)
    assert kept == {"iteration": 7, "rng": {("cpu", 1234, 1, "grads"): torch.tensor([1], dtype=torch.uint8)},
                    "main_shards": {}}
    assert new == {"iteration": 7, "rng": {}, "main_shards": {}}


def test_main_shards_for_another_size_are_refused_in_one_line(tmp_path):
    _save(tmp_path, world=4, dp=4, main_shards=True)
    with pytest.raises(Refused) as refused:
        decide(str(tmp_path), _layout(2, 2, 0), saved_with_layer=True)
    line = str(refused.value)
    assert "\n" not in line and "exact fp32 main shards" in line
    assert "data-parallel 4" in line and "data-parallel 2" in line


def test_another_model_parallelism_is_refused(tmp_path):
    _save(tmp_path, world=4, dp=2, model_parallel=(2, 1, 1, 1))
    with pytest.raises(Refused, match="model-parallel shards"):
        decide(str(tmp_path), _layout(4, 4, 0), saved_with_layer=True)


@pytest.mark.parametrize("rank", [0, 3])
def test_a_missing_rank_file_is_refused_naming_it(tmp_path, rank):
    """Rank 0's file too: before, a missing rank_00000.pt read as "saved without --sdp4bit"
    and every rank dropped its own intact state."""
    _save(tmp_path, world=4, dp=4)
    os.remove(resume_state.rank_file(str(tmp_path), rank))
    for saved_with_layer in (True, None):  # the saved args asked for it, or recorded nothing
        with pytest.raises(Refused, match=f"rank_{rank:05d}.pt is missing: the checkpoint's SDP4Bit state is "
                                          "incomplete"):
            decide(str(tmp_path), _layout(4, 4, rank), saved_with_layer)


def test_no_layer_folder_is_missing_state_when_the_saved_args_asked_for_it(tmp_path):
    with pytest.raises(Refused, match="rank_00000.pt is missing"):
        decide(str(tmp_path), _layout(4, 4, 1), saved_with_layer=True)


def test_a_saved_rank_missing_its_file_for_another_size_is_refused(tmp_path):
    """Before: that rank started fresh rounding streams, silently."""
    _save(tmp_path, world=2, dp=2)
    os.remove(resume_state.rank_file(str(tmp_path), 1))
    with pytest.raises(Refused, match="rank_00001.pt is missing"):
        decide(str(tmp_path), _layout(4, 4, 1), saved_with_layer=True)


@pytest.mark.parametrize("content", [b"not a checkpoint", None])
def test_damaged_and_foreign_rank_files_are_refused_naming_them(tmp_path, content):
    _save(tmp_path, world=4, dp=4)
    path = resume_state.rank_file(str(tmp_path), 2)
    if content is None:  # a readable file that is not the layer's (before: a KeyError traceback)
        torch.save({"something": "else"}, path)
    else:
        with open(path, "wb") as f:
            f.write(content)
    with pytest.raises(Refused) as refused:
        decide(str(tmp_path), _layout(4, 4, 2), saved_with_layer=True)
    line = str(refused.value)
    assert line.startswith(f"{path} is ") and "\n" not in line, line
    assert ("unreadable" if content else "not an SDP4Bit state file") in line


def test_a_checkpoint_saved_without_the_layer_has_no_state(tmp_path):
    assert decide(str(tmp_path), _layout(4, 4, 0), saved_with_layer=False) is None
    assert decide(str(tmp_path), _layout(4, 4, 0), saved_with_layer=None) is None


def test_every_rank_acts_on_the_first_refusal():
    assert resume_state.agree("f", [("state", None)] * 4) is None
    assert resume_state.agree("f", [("none", None)] * 4) is None
    one = resume_state.agree("f", [("state", None), ("refused", "f/sdp4bit/rank_00001.pt is missing: ..."),
                                   ("state", None), ("state", None)])
    assert one == "f/sdp4bit/rank_00001.pt is missing: ..."
    two = resume_state.agree("f", [("refused", "a"), ("state", None), ("refused", "b"), ("refused", "c")])
    assert two == "a (rank 0; 2 other ranks refused too)"
    # Ranks that saw the layer's files and ranks that did not (no shared filesystem)
    split = resume_state.agree("f", [("state", None), ("none", None)])
    assert split.startswith("f: ranks [0] found SDP4Bit state in it and the other ranks none")


def test_report_says_what_the_rank_decided():
    assert resume_state.report({"iteration": 1}) == ("state", None)
    assert resume_state.report(None) == ("none", None)
    assert resume_state.report(Refused("line")) == ("refused", "line")


def test_what_the_saved_args_asked_for():
    assert checkpoint.saved_with_layer({"args": argparse.Namespace(sdp4bit=True)}) is True
    assert checkpoint.saved_with_layer({"args": argparse.Namespace(sdp4bit=False, sdp4bit_preset=None)}) is False
    assert checkpoint.saved_with_layer({"args": argparse.Namespace(num_layers=2)}) is False  # a stock run
    assert checkpoint.saved_with_layer({"args": argparse.Namespace(sdp4bit_preset="baseline")}) is False
    assert checkpoint.saved_with_layer({"iteration": 3}) is None
    assert checkpoint.saved_with_layer(None) is None


class _Recorder:
    def __init__(self):
        self.calls = []

    def add_scalar(self, name, value, iteration):
        self.calls.append((name, value, iteration))

    def log(self, scalars, iteration):
        self.calls.append((scalars, iteration))


def test_figures_go_to_the_iteration_line_and_both_writers():
    figures = {"bytes-sent": 1 << 20, "bytes-exact": 4 << 20, "replica-checks-passed": 5,
               "quant-error-weight": 0.0125}
    fields = reporting.iteration_line_fields(figures)
    assert fields == (" sdp4bit bytes sent/exact: 0.250 (1.00/4.00 MiB) | sdp4bit replica checks passed: 5 |"
                      " sdp4bit weight error: 1.250E-02 |")
    tensorboard, wandb = _Recorder(), _Recorder()
    reporting.write_figures((lambda: tensorboard, lambda: wandb), figures, 10)
    expected = {"sdp4bit/bytes-sent": 1 << 20, "sdp4bit/bytes-exact": 4 << 20,
                "sdp4bit/replica-checks-passed": 5, "sdp4bit/quant-error-weight": 0.0125,
                "sdp4bit/bytes-ratio": 0.25}
    assert {name: value for name, value, step in tensorboard.calls if step == 10} == expected
    assert wandb.calls == [(expected, 10)]
    reporting.write_figures((lambda: None, lambda: None), figures, 11)  # not configured: nothing to do


def test_the_overlapped_collectives_waits_go_to_the_iteration_line_when_there_were_any():
    figures = {"bytes-sent": 0, "bytes-exact": 0, "replica-checks-passed": 0,
               "waited-reduce-scatter": 0.0191, "waited-all-gather": 0.046}
    assert reporting.iteration_line_fields(figures).endswith(" sdp4bit waited RS 19 + AG 46 ms/iter |")
    del figures["waited-all-gather"]  # the gathers not overlapped: not timed, not shown as 0
    assert reporting.iteration_line_fields(figures).endswith(" sdp4bit waited RS 19 ms/iter |")
    del figures["waited-reduce-scatter"]  # no overlap flag, or NCCL's side stream
    assert "waited" not in reporting.iteration_line_fields(figures)


def test_the_gradient_group_shape_goes_to_the_iteration_line():
    figures = {"bytes-sent": 0, "bytes-exact": 0, "replica-checks-passed": 0,
               "grad-groups-crest-p99": 9.5, "grad-groups-crest-share-above-8": 0.0213,
               "grad-groups-error-tlq": 0.2634, "grad-groups-error-tlq-hs": 0.1612}
    assert reporting.iteration_line_fields(figures).endswith(
        " sdp4bit grad groups crest p99: 9.50 (2.13% above 8), 4-bit error TLq/TLq-HS: 0.263/0.161 |")


def _save_sites(tmp_path, monkeypatch, seen):
    """Megatron-LM's ``save_checkpoint`` stood in by one that records, when it runs, whether
    this rank's layer file already exists, names the iteration in its tracker file, and
    logs megatron-core's warning about a non-empty folder (as ``torch_dist`` does)."""
    import logging
    from types import SimpleNamespace

    from megatron_sdp4bit.megatron import patch

    monkeypatch.setattr(patch, "is_installed", lambda: True)
    monkeypatch.setattr(patch, "state_dict", lambda optimizer: {"iteration": 5})
    monkeypatch.setattr(patch, "optimizer_group", lambda optimizer: (0, 1))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    args = SimpleNamespace(save=str(tmp_path), non_persistent_global_ckpt_dir=None)

    def get_checkpoint_name(save_dir, iteration, release=False, return_base_dir=True):
        return os.path.join(save_dir, f"iter_{iteration:07d}")

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                        checkpointing_context=None, non_persistent_ckpt=False, **_):
        save_dir = os.path.join(str(tmp_path), "np") if non_persistent_ckpt else str(tmp_path)
        folder = get_checkpoint_name(save_dir, iteration)
        seen.append(os.path.exists(resume_state.rank_file(folder, 0)))
        os.makedirs(folder, exist_ok=True)
        logging.getLogger("megatron.core.dist_checkpointing.serialization").warning(
            checkpoint.OVERWRITING + "...")
        with open(os.path.join(str(tmp_path), "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))

    checkpointing = SimpleNamespace(get_checkpoint_name=get_checkpoint_name, _NON_PERSISTENT_CKPT_SUBDIR="np")
    sites = SimpleNamespace(get_args=lambda: args, checkpointing=checkpointing)
    return checkpoint._wrap_save(sites, save_checkpoint)


def test_the_layers_files_exist_before_megatron_names_the_iteration(tmp_path, monkeypatch, caplog):
    """Megatron-LM's save ends by writing its tracker file (and may then delete the previous
    checkpoint): the layer's files are written before it runs, so no kill can leave a latest
    checkpoint without them. megatron-core's "Overwriting old incomplete" warning, which
    those files would set off, is dropped while they are all the folder holds."""
    import logging

    seen = []
    save = _save_sites(tmp_path, monkeypatch, seen)
    with caplog.at_level(logging.WARNING, logger="megatron.core.dist_checkpointing.serialization"):
        save(10, "model", "optimizer", None, 0)
    assert seen == [True]
    assert os.path.isfile(resume_state.rank_file(str(tmp_path / "iter_0000010"), 0))
    assert not [r for r in caplog.records if checkpoint.OVERWRITING in r.getMessage()]
    # a folder that holds something else really was an incomplete save: the warning stays
    stale = tmp_path / "iter_0000020"
    stale.mkdir()
    (stale / "common.pt").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="megatron.core.dist_checkpointing.serialization"):
        save(20, "model", "optimizer", None, 0)
    assert [r for r in caplog.records if checkpoint.OVERWRITING in r.getMessage()]
    assert not logging.getLogger("megatron.core.dist_checkpointing.serialization").filters


def test_a_non_persistent_save_writes_the_layers_files_after_megatrons(tmp_path, monkeypatch):
    """megatron keeps only the newest ``iter_*`` folder of the non-persistent directory when
    such a save starts: a folder of the layer's, made first, would make it delete the last
    complete checkpoint."""
    seen = []
    save = _save_sites(tmp_path, monkeypatch, seen)
    save(10, "model", "optimizer", None, 0, non_persistent_ckpt=True)
    assert seen == [False]
    assert os.path.isfile(resume_state.rank_file(str(tmp_path / "np" / "iter_0000010"), 0))


def _restore_on_one_rank(tmp_path, monkeypatch, misfit):
    """``checkpoint._restore`` on a world of one rank, the layer stood in: its refusal
    of the saved main shards is ``misfit`` (or it raises ``misfit``); returns what it
    loaded."""
    from types import SimpleNamespace

    from megatron_sdp4bit.megatron import patch

    loaded = []
    monkeypatch.setattr(patch, "optimizer_group", lambda optimizer: (0, 1))
    def refusal(state, optimizer):
        if isinstance(misfit, Exception):
            raise misfit
        return misfit

    monkeypatch.setattr(patch, "main_shards_refusal", refusal)
    monkeypatch.setattr(patch, "load_state_dict", lambda state, optimizer: loaded.append(state))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj, group=None: out.__setitem__(0, obj))
    _save(tmp_path, world=1, dp=1, main_shards=True)
    checkpoint._restore(SimpleNamespace(get_args=SimpleNamespace), "optimizer", str(tmp_path), True, 7)
    return loaded


def test_main_shards_that_do_not_fit_are_refused_in_one_line_on_every_rank(
        tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _restore_on_one_rank(tmp_path, monkeypatch, "its exact fp32 main shard of bucket 1 ... does not fit")
    assert f"sdp4bit: {tmp_path}: its exact fp32 main shard of bucket 1 ... does not fit" in capsys.readouterr().err
    assert len(_restore_on_one_rank(tmp_path, monkeypatch, None)) == 1


def test_a_state_this_rank_cannot_take_is_refused_in_one_line_not_raised_alone(tmp_path, monkeypatch, capsys):
    """Raised on one rank before the ranks compare their decisions, an error would leave
    the others waiting in the all-gather: it becomes this rank's refusal."""
    with pytest.raises(SystemExit):
        _restore_on_one_rank(tmp_path, monkeypatch, TypeError("object of type 'int' has no len()"))
    err = capsys.readouterr().err
    assert f"sdp4bit: {tmp_path}: rank 0 cannot take its SDP4Bit state (TypeError: object of type 'int' has " \
           "no len()); load an earlier iteration (--ckpt-step)" in err
