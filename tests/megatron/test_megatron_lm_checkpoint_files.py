"""Which saved SDP4Bit state each rank resumes from, and the log figures' wording.

``megatron_lm/checkpoint.py`` writes one file per rank beside Megatron-LM's checkpoint;
``layer_state_for_resume`` picks this rank's state for the layout of the resuming run.
Checked here on files the test writes (no megatron, no processes): the same layout
takes its own file; another data-parallel size keeps the step count, a saved rank's
streams and gives a new rank fresh ones; exact main shards or another model
parallelism for another size, and a missing or damaged rank file, are refused in one
line (``SystemExit`` with exit code 2; the line is printed by rank 0).
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_sdp4bit.megatron_lm import checkpoint, reporting


def _layout(world, dp, rank, model_parallel=(1, 1, 1, 1)):
    return {"world_size": world, "rank": rank, "data_parallel_size": dp, "data_parallel_rank": rank % dp,
            "model_parallel": list(model_parallel)}


def _save(folder, world, dp, main_shards=False, model_parallel=(1, 1, 1, 1)):
    for rank in range(world):
        path = checkpoint.rank_file(str(folder), rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"iteration": 7, "rng": {("cpu", 1234, rank, "grads"): torch.tensor([rank], dtype=torch.uint8)},
                 "main_shards": {(0, 0): torch.full((4,), float(rank))} if main_shards else {}}
        torch.save({"layout": _layout(world, dp, rank, model_parallel), "state": state}, path)


@pytest.fixture(autouse=True)
def _quiet_refusals(monkeypatch):
    """Refusals print on RANK 0 and make other ranks wait: here, rank 0."""
    monkeypatch.setenv("RANK", "0")


def test_same_layout_takes_its_own_file(tmp_path):
    _save(tmp_path, world=4, dp=4, main_shards=True)
    state = checkpoint.layer_state_for_resume(str(tmp_path), _layout(4, 4, 2))
    assert state["iteration"] == 7
    assert list(state["rng"]) == [("cpu", 1234, 2, "grads")]
    assert torch.equal(state["main_shards"][(0, 0)], torch.full((4,), 2.0))


def test_another_data_parallel_size_keeps_the_step_count_and_saved_streams(tmp_path):
    _save(tmp_path, world=2, dp=2)
    kept = checkpoint.layer_state_for_resume(str(tmp_path), _layout(4, 4, 1))
    new = checkpoint.layer_state_for_resume(str(tmp_path), _layout(4, 4, 3))
    assert kept == {"iteration": 7, "rng": {("cpu", 1234, 1, "grads"): torch.tensor([1], dtype=torch.uint8)},
                    "main_shards": {}}
    assert new == {"iteration": 7, "rng": {}, "main_shards": {}}


def test_main_shards_for_another_size_are_refused_in_one_line(tmp_path, capsys):
    _save(tmp_path, world=4, dp=4, main_shards=True)
    with pytest.raises(SystemExit) as stop:
        checkpoint.layer_state_for_resume(str(tmp_path), _layout(2, 2, 0))
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdp4bit: ")
    assert "exact fp32 main shards" in lines[0] and "data-parallel 4" in lines[0] and "data-parallel 2" in lines[0]


def test_another_model_parallelism_is_refused(tmp_path, capsys):
    _save(tmp_path, world=4, dp=2, model_parallel=(2, 1, 1, 1))
    with pytest.raises(SystemExit):
        checkpoint.layer_state_for_resume(str(tmp_path), _layout(4, 4, 0))
    assert "model-parallel shards" in capsys.readouterr().err


def test_missing_and_damaged_rank_files_are_refused(tmp_path, capsys):
    _save(tmp_path, world=4, dp=4)
    os.remove(checkpoint.rank_file(str(tmp_path), 3))
    with pytest.raises(SystemExit):
        checkpoint.layer_state_for_resume(str(tmp_path), _layout(4, 4, 3))
    assert "rank_00003.pt is missing" in capsys.readouterr().err
    with open(checkpoint.rank_file(str(tmp_path), 2), "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(SystemExit):
        checkpoint.layer_state_for_resume(str(tmp_path), _layout(4, 4, 2))
    assert "is unreadable" in capsys.readouterr().err


def test_a_checkpoint_without_the_layer_has_no_state(tmp_path):
    assert checkpoint.layer_state_for_resume(str(tmp_path), _layout(4, 4, 0)) is None


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
