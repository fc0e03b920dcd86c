"""``make train`` draws its run over the shipped exact-collective run of the same recipe."""
from __future__ import annotations

import json
import os

import pytest

from megatron_sdp4bit import demo


def _metrics(run_dir, losses):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for i, loss in enumerate(losses, start=1):
            f.write(json.dumps({"kind": "train", "iteration": 10 * i, "loss": loss}) + "\n")
        f.write(json.dumps({"kind": "valid", "iteration": 10 * len(losses), "loss": losses[-1]}) + "\n")


def test_the_shipped_reference_is_this_recipe_with_the_exact_collectives():
    with open(demo.REFERENCE) as f:
        reference = json.load(f)
    assert reference["recipe_flags"] == demo.RECIPE_FLAGS
    assert reference["valid"][-1][0] == int(demo.RECIPE_FLAGS[demo.RECIPE_FLAGS.index("--train-iters") + 1])
    assert reference["train"][0][1] > reference["train"][-1][1]  # it learned


def test_overlay_is_drawn_for_the_recipe_and_says_the_difference(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib: pip install -e .[plots] (make test installs it)")
    run_dir = str(tmp_path / "run")
    _metrics(run_dir, [8.0, 6.0, 5.7])
    png = demo.overlay_on_reference(run_dir, ["--sdp4bit-preset", "zeropp"])
    assert png == os.path.join(run_dir, "loss_vs_exact.png") and os.path.getsize(png) > 0
    assert "with the exact collectives" in capsys.readouterr().out


def test_no_overlay_when_the_flags_change_the_recipe(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    _metrics(run_dir, [8.0, 6.0])
    assert demo.overlay_on_reference(run_dir, ["--train-iters", "20"]) is None
    assert "changed: --train-iters" in capsys.readouterr().out
