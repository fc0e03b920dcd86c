"""megatron_sdp4bit.recipes: the small GPT recipes as driver flags.

The studies' results record these lists (``make train``'s shipped reference, the
accuracy study's fingerprint), so their flags and order are pinned here; every
recipe must also parse as the driver's command line.
"""
from __future__ import annotations

import json

import pytest

from megatron_sdp4bit import demo, recipes

ALL = {"MAKE_TRAIN": recipes.MAKE_TRAIN, "SLOW_LINK": recipes.SLOW_LINK,
       "ACCURACY_CPU": recipes.ACCURACY_CPU,
       "ACCURACY_CPU_OUTLIERS": recipes.ACCURACY_CPU_OUTLIERS, "SOAK": recipes.SOAK, "STEP_WORK": recipes.STEP_WORK,
       "GPU_CHECK": recipes.gpu_check_recipe(12, 768, 12, 1024, 8, 60, 10, data_parallel=4)}


def test_make_train_is_the_recipe_its_reference_was_made_with():
    with open(demo.REFERENCE) as f:
        assert json.load(f)["recipe_flags"] == recipes.MAKE_TRAIN.flags() == demo.RECIPE_FLAGS


def test_the_accuracy_study_keeps_its_flags_in_order():
    assert recipes.ACCURACY_CPU.flags() == [
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--train-iters", "400", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "20",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--use-distributed-optimizer",
        "--log-interval", "10", "--eval-interval", "50", "--eval-iters", "16",
        "--split", "969,30,1", "--default-corpus-mb", "8"]


def test_the_outlier_recipe_is_make_trains_model_at_ten_times_the_learning_rate():
    flags = recipes.ACCURACY_CPU_OUTLIERS.flags()
    assert flags == [
        "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--train-iters", "400", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "20",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--use-distributed-optimizer",
        "--log-interval", "10", "--eval-interval", "50", "--eval-iters", "16",
        "--split", "969,30,1", "--default-corpus-mb", "8"]


def test_a_field_left_none_writes_no_flag_and_extra_comes_last():
    flags = recipes.STEP_WORK.flags()
    assert "--lr" not in flags and "--global-batch-size" not in flags
    assert flags[-4:] == ["--bf16", "--default-corpus-mb", "1", "--no-progress-bar"]
    assert "--use-distributed-optimizer" not in recipes.SLOW_LINK.flags()
    gpu = ALL["GPU_CHECK"].flags()
    assert gpu[gpu.index("--global-batch-size") + 1] == "32"  # 8 per rank x 4 ranks
    assert gpu[gpu.index("--eval-interval") + 1] == "600"  # after the end: one evaluation


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_recipe_is_a_command_line_the_driver_accepts(name):
    from megatron_sdp4bit.training.arguments import parse_args

    args = parse_args(ALL[name].flags() + ["--train-iters", "3"] * (ALL[name].train_iters is None))
    assert args.num_layers == ALL[name].num_layers and args.seq_length == ALL[name].seq_length
