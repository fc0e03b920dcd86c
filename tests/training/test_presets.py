"""Every SDP4Bit preset is the same optimizer with other collectives (issue 18 item 4).

``--sdp4bit-preset baseline`` (the exact collectives) used to turn the distributed
optimizer off: another optimizer, its bytes "not counted", the replica check off,
and a checkpoint of one preset refused by the other (``dtypes [['float32',
'float32']], this run has []``). Now every preset implies
``--use-distributed-optimizer``; a checkpoint of one preset resumes with another
with one warning line. One forked world of 2 gloo ranks (2 emulated nodes).
"""
from __future__ import annotations

import os

import pytest

from driver_runs import TINY_GPT, captured_run, driver_world, train_records
from megatron_sdp4bit.config import PRESETS
from megatron_sdp4bit.training.arguments import parse_args

TINY = TINY_GPT + ["--lr-decay-iters", "4", "--bf16",
                   "--sdp4bit-ranks-per-node", "1", "--sdp4bit-check-interval", "1"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_implies_the_distributed_optimizer(name):
    assert parse_args(["--sdp4bit-preset", name]).use_distributed_optimizer
    assert parse_args(["--sdp4bit-check-interval", "5"]).use_distributed_optimizer  # baseline + a field
    assert not parse_args([]).use_distributed_optimizer  # no SDP4Bit flag: Megatron-LM's default


def _world(rank, world_size, root):
    def go(name, flags):
        return captured_run(TINY + ["--run-dir", os.path.join(root, name)] + flags)

    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    return {
        "sdp": go("sdp", ["--sdp4bit", "--train-iters", "2", "--save", a]),
        "baseline_resumed": go("baseline_resumed", ["--sdp4bit-preset", "baseline", "--train-iters", "4",
                                                    "--load", a]),
        "baseline": go("baseline", ["--sdp4bit-preset", "baseline", "--train-iters", "2", "--save", b]),
        "sdp_resumed": go("sdp_resumed", ["--sdp4bit", "--train-iters", "4", "--load", b]),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return driver_world(tmp_path_factory, "presets", _world, 2, timeout_s=600)


def test_the_baseline_is_measured_as_every_preset(world):
    """Bytes counted (the exact collectives' own: ratio 1), the replica check on."""
    root, results = world
    for name in ("baseline", "baseline_resumed"):
        assert results[0][name]["error"] is None, results[0][name]["error"]
        assert [r["wire_ratio"] for r in train_records(root, name)] == [1.0] * len(train_records(root, name))
        assert results[0][name]["summary"]["bytes_exact"] > 0
        assert results[0][name]["summary"]["replica_checks_passed"] >= 2
    assert 0 < train_records(root, "sdp")[-1]["wire_ratio"] < 0.35  # 4-bit codes between the 2 emulated nodes


@pytest.mark.parametrize("resumed, saved, used", [("baseline_resumed", "a", ("sdp4bit", "baseline")),
                                                  ("sdp_resumed", "b", ("baseline", "sdp4bit"))])
def test_a_checkpoint_of_one_preset_resumes_with_another_with_one_warning(world, resumed, saved, used):
    root, results = world
    result = results[0][resumed]
    assert result["error"] is None, result["error"]
    warnings = [line for line in result["stdout"].splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"warning: checkpoint {os.path.join(root, saved, 'iter_0000002')} was saved with SDP4Bit preset "
        f"{used[0]}, this run uses preset {used[1]} (")
    assert f"resumed from {os.path.join(root, saved)} at iteration 2" in result["stdout"]
    assert [r["iteration"] for r in train_records(root, resumed)] == [3, 4]
