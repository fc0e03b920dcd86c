"""Bad input to the driver: a clear error before training starts, nothing saved lost.

Flag errors are checked in-process (parsing imports no megatron); errors found
once the process group exists run the real CLI in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_sdp4bit.flag_errors import report_bad_flag
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
    (["--tensor-model-parallel-size", "0"], r"argument --tensor-model-parallel-size: must be an integer >= 1"),
    (["--save-interval", "5"], "--save"),
    (["--lr-warmup-iters", "2"], "--lr-decay-iters 2"),
    (["--sdp4bit", "--sdp4bit-weight-bits", "3"], r"--sdp4bit-weight-bits 3: .*use one of \(2, 4, 8\)"),
    # issue 28, round two: before, SIGUSR1 then ended the run without a word
    (["--exit-signal", "SIGUSR1"], r"^--exit-signal SIGUSR1 is handled by the exit-signal handler, which is off "
     r"\(no --save\): add --save DIR \(or --exit-signal-handler\), or drop --exit-signal$"),
    (["--exit-signal", "SIGUSR2", "--save", "ck", "--no-exit-signal-handler"], r"which is off \(--no-exit-signal"),
])
def test_flag_errors_name_the_flag(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(TINY + argv)


# Every value issue 12 found accepted (or caught late): refused by the parser, the
# message naming the flag, its value and what it may be.
@pytest.mark.parametrize("argv, message", [
    (["--sdp4bit-hadamard-block", "48"], r"--sdp4bit-hadamard-block 48: .*power of two in 2\.\.256"),
    (["--sdp4bit-hadamard-block", "512"], r"--sdp4bit-hadamard-block 512: .*power of two"),
    (["--sdp4bit-grad-group-size-intra", "100"], r"--sdp4bit-grad-group-size-intra 100: .*multiple of hadamard_block=32"),
    (["--sdp4bit-grad-group-size-inter", "48"], r"--sdp4bit-grad-group-size-inter 48: .*multiple of hadamard_block=32"),
    (["--sdp4bit-pipeline-chunks", "0"], r"--sdp4bit-pipeline-chunks 0: .*integer >= 1"),
    (["--sdp4bit-weight-group-size", "0"], r"--sdp4bit-weight-group-size 0: .*integer >= 1"),
    (["--sdp4bit-weight-group-size", "-2"], r"--sdp4bit-weight-group-size -2: .*integer >= 1"),
    (["--sdp4bit-weight-group-size", "3"], r"--sdp4bit-weight-group-size 3: .*multiple of 2"),
    (["--sdp4bit-ranks-per-node", "0"], r"--sdp4bit-ranks-per-node 0: .*integer >= 1"),
    (["--sdp4bit-grad-start-iter", "-5"], r"--sdp4bit-grad-start-iter -5: .*integer >= 0"),
    (["--sdp4bit-weight-group-size", "2k"], r"--sdp4bit-weight-group-size: expects an integer, got '2k'"),
    (["--sdp4bit-hadamard-block", "256"], r"--sdp4bit-grad-group-size-intra \(preset sdp4bit: 128\): .*hadamard_block=256"),
    (["--wq-group-size", "3"], r"--wq-group-size 3: .*multiple of 2"),
    (["--lr", "nan"], r"argument --lr: must be a finite number > 0, got 'nan'"),
    (["--lr", "-1"], r"argument --lr: must be a finite number > 0, got '-1'"),
    (["--lr", "inf"], r"argument --lr: must be a finite number > 0"),
    (["--min-lr=-1e-5"], r"argument --min-lr: must be a finite number >= 0"),
    (["--adam-beta2", "1"], r"argument --adam-beta2: must be a finite number >= 0 and < 1"),
    (["--hidden-dropout", "1.5"], r"argument --hidden-dropout"),
    (["--num-layers", "0"], r"argument --num-layers: must be an integer >= 1, got '0'"),
    (["--train-iters", "ten"], r"argument --train-iters: must be an integer >= 1, got 'ten'"),
    (["--save-interval", "0", "--save", "x"], r"argument --save-interval: must be an integer >= 1"),
])
def test_bad_values_are_refused_by_the_parser(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(TINY + ["--sdp4bit"] + argv)


def test_help_exits_0_and_shows_allowed_values():
    for module in ("megatron_sdp4bit.pretrain", "megatron_sdp4bit.launch"):
        result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                                text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert result.returncode == 0, (module, result.stderr)
        text = " ".join(result.stdout.split())
        assert "--sdp4bit-hadamard-block N a power of two in 2..256" in text, module
        assert ("--sdp4bit-grad-mode MODE one of tlq-hs (two-level-hadamard), tlq (two-level), "
                "ulq (two-level-uniform), off (exact)") in text, module


def test_a_bad_flag_under_torchrun_is_one_line_from_rank_0_and_exit_2(tmp_path):
    """Before any process group exists: no traceback, no second copy from rank 1."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.1", "-m", "megatron_sdp4bit.pretrain", *TINY,
               "--sdp4bit", "--sdp4bit-weight-group-size", "3"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("sdp4bit-pretrain:")]
    assert ours == ["sdp4bit-pretrain: error: --sdp4bit-weight-group-size 3: weight_group_size=3 must be "
                    "a positive multiple of 2 (2 4-bit codes share a byte), e.g. 2"], result.stderr
    # The one traceback is torchrun's own report (ChildFailedError), with each rank's exit code.
    assert result.stderr.count("Traceback") <= 1 and "megatron_sdp4bit/" not in result.stderr
    assert "exitcode  : 2" in result.stderr


def test_only_rank_0_reports_and_the_others_wait_for_the_launcher(monkeypatch, capsys):
    """Rank 1 leaving first let torchrun stop rank 0 before it printed (a CI failure)."""
    monkeypatch.setenv("RANK", "1")
    start = time.monotonic()
    assert report_bad_flag("bad flag", wait_s=0.3) == 2
    assert time.monotonic() - start >= 0.3
    monkeypatch.setenv("RANK", "0")
    start = time.monotonic()
    assert report_bad_flag("bad flag", wait_s=30) == 2
    assert time.monotonic() - start < 5
    assert capsys.readouterr().err == "bad flag\n"


def test_yaml_config_with_flags_overriding(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num_layers: 3\nhidden-size: 48\nbf16: true\nsdp4bit: true\n"
                    "data_path: [a, b]\ntokenizer_type: GPT2BPETokenizer\n")
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
        (["--data-path", str(tmp_path / "missing"), "--save", str(save), "--load", str(save),
          "--train-iters", "20"], "missing.bin"),
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
