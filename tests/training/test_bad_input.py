"""Bad input to the driver: a clear error before training starts, nothing saved lost.

Flag errors are checked in-process (parsing imports no megatron); errors found
once the process group exists run the real CLI in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_sdp4bit.training.arguments import ArgumentError, parse_args
from megatron_sdp4bit.training.checkpoint import LATEST, latest_iteration

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--train-iters", "2", "--micro-batch-size", "1"]


@pytest.mark.parametrize("argv, message", [
    (["--seq-length", "300", "--max-position-embeddings", "256"], "--max-position-embeddings"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
    (["--overlap-param-gather"], "--overlap-grad-reduce"),
    (["--hidden-size", "30", "--num-attention-heads", "4"], "--num-attention-heads"),
    (["--tensor-model-parallel-size", "2"], "data parallelism only"),
    (["--save-interval", "5"], "--save"),
    (["--lr-warmup-iters", "2"], "--lr-decay-iters 2"),
    (["--sdp4bit", "--sdp4bit-weight-bits", "3"], "invalid choice"),
])
def test_flag_errors_name_the_flag(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(TINY + argv)


def test_yaml_config_with_flags_overriding(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num_layers: 3\nhidden-size: 48\nbf16: true\nsdp4bit: true\n"
                    "data_path: [a, b]\n")
    args = parse_args(["--config", str(path), "--num-layers", "5"])
    assert (args.num_layers, args.hidden_size, args.bf16) == (5, 48, True)
    assert args.data_path == ["a", "b"] and args.sdp4bit_config.weight_mode == "diff"
    path.write_text("hidden_sise: 48\n")
    with pytest.raises(ArgumentError, match="unknown key 'hidden_sise'"):
        parse_args(["--config", str(path)])


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))))
def test_shipped_configs_parse(name):
    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    args = parse_args(["--config", os.path.join(configs, name)])
    assert args.num_layers > 0 and args.sdp4bit_config is not None


def _cli(*argv, cwd):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, *argv],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_runtime_input_errors_are_clear_and_keep_checkpoints(tmp_path):
    save = tmp_path / "ckpt"
    (save / "iter_0000010").mkdir(parents=True)
    (save / "iter_0000010" / "rank_00000.pt").write_bytes(b"an earlier good checkpoint")
    (save / LATEST).write_text("10\n")
    corrupt = tmp_path / "corrupt_text_document"
    (tmp_path / "corrupt_text_document.bin").write_bytes(b"\0" * 64)
    (tmp_path / "corrupt_text_document.idx").write_bytes(b"not an index")
    from megatron_sdp4bit.data.indexed_files import write_indexed_dataset

    write_indexed_dataset(str(tmp_path / "good_text_document"), [[1, 2, 3, 0]] * 8, vocab_size=16)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cases = [
        (["--data-path", str(tmp_path / "missing"), "--save", str(save)], "missing.bin"),
        (["--data-path", str(corrupt), "--tokenizer-type", "GPT2BPETokenizer"], "corrupt_text_document.idx"),
        (["--data-path", str(tmp_path / "good_text_document")], "--tokenizer-type"),
        (["--global-batch-size", "3", "--micro-batch-size", "2"], "--global-batch-size 3"),
        (["--save", str(blocker / "sub")], "not writable"),
    ]
    for argv, message in cases:
        result = _cli(*argv, cwd=str(tmp_path))
        assert result.returncode == 2, (argv, result.stderr[-2000:])
        assert message in result.stderr, (argv, result.stderr[-2000:])
        assert "iter " not in result.stdout  # failed before the first step
    assert (save / LATEST).read_text() == "10\n"
    assert (save / "iter_0000010" / "rank_00000.pt").read_bytes() == b"an earlier good checkpoint"


def test_corrupt_index_is_named(tmp_path):
    from megatron_sdp4bit.data.indexed_files import check_indexed_prefix

    prefix = tmp_path / "bad"
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    with pytest.raises(ValueError, match="bad.idx"):
        check_indexed_prefix(str(prefix))


def test_an_interrupted_save_leaves_the_last_checkpoint_current(tmp_path):
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / LATEST).write_text("10\n")
    partial = tmp_path / "iter_0000020.tmp"  # what a save killed half-way leaves
    partial.mkdir()
    (partial / "rank_00000.pt.part").write_bytes(b"half")
    assert latest_iteration(str(tmp_path)) == 10
