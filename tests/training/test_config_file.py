"""Mistakes in a ``--config`` file are named with their file and line, typos with the
nearest flag, and ``--help`` names every default (issue 28).

Before: a YAML syntax error or a non-UTF-8 file gave a yaml/codec traceback; a bad
value in the file (``lr: abc``) and values contradicting each other were said
without the file; a key given twice silently took the last value; an unknown key
had no line and no suggestion, nor had a typo'd flag; a folder was "no such file";
``--help`` showed no default for most flags.
"""
from __future__ import annotations

import re

import pytest

from megatron_sdp4bit.training.arguments import ArgumentError, build_parser, parse_args


@pytest.mark.parametrize("text, words", [
    ("num_layers: 2\nlr: [1\n", r"run\.yaml, line 3, column 1: not valid YAML \(expected ',' or '\]'"),
    ("num_layers: 2\n\tlr: 1\n", r"run\.yaml, line 2, column 1: not valid YAML"),
    ("num_layers: 2\nnum_layer: 3\n", r"run\.yaml, line 2: unknown key 'num_layer' \(no flag --num-layer\); "
                                     r"did you mean --num-layers\?"),
    ("num_layers: 2\nnum_layers: 3\n", r"run\.yaml, line 2: num_layers is given twice \(first on line 1\)"),
    ("num_layers: 2\nlr: abc\n", r"argument --lr: must be a finite number > 0, got 'abc' \(--config .*run\.yaml: "
                                 r"--lr on line 2\)"),
    ("seq_length: 2048\nmax_position_embeddings: 1024\n",
     r"longer than --max-position-embeddings 1024.* \(--config .*run\.yaml: --seq-length on line 1, "
     r"--max-position-embeddings on line 2\)"),
    ("bf16: 'yes'\n", r"run\.yaml, line 1: bf16 takes true or false"),
    ("- num_layers\n", r"expected a mapping of flag names to values .*got a list"),
    ("lr:\n  peak: 1\n", r"run\.yaml, line 1: lr takes a value, not a mapping"),
])
def test_a_mistake_in_the_file_names_the_file_and_line(tmp_path, text, words):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ArgumentError) as error:
        parse_args(["--config", str(path)])
    assert re.search(words, str(error.value)), str(error.value)
    assert "\n" not in str(error.value)


def test_a_file_that_is_no_yaml_text_or_a_folder(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xff\xfe num_layers: 2")
    with pytest.raises(ArgumentError, match=r"run\.yaml is not UTF-8 text"):
        parse_args(["--config", str(path)])
    with pytest.raises(ArgumentError, match="is a folder: pass a YAML file"):
        parse_args(["--config", str(tmp_path)])


def test_the_command_line_overrides_the_file_and_is_not_blamed_on_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seq_length: 2048\nmax_position_embeddings: 1024\n")
    assert parse_args(["--config", str(path), "--seq-length", "512"]).seq_length == 512
    with pytest.raises(ArgumentError) as error:
        parse_args(["--config", str(path), "--lr", "0"])
    assert "run.yaml" not in str(error.value)


@pytest.mark.parametrize("argv, suggestion", [
    (["--lrr", "1"], "--lr"), (["--num-layer", "2"], "--num-layers"), (["--train-iter=5"], "--train-iters"),
])
def test_a_typo_on_the_command_line_names_the_nearest_flag(argv, suggestion):
    with pytest.raises(ArgumentError, match=f"unrecognized arguments: .*; did you mean {suggestion}\\?"):
        parse_args(argv)


def test_help_names_the_default_of_every_flag_that_has_one(capsys):
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and not (action.default is None or action.default is False
                                          or action.default == "==SUPPRESS=="):
            entry = parser._get_formatter()._format_action(action)
            assert "default" in entry or "preset" in entry, entry
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--log-interval LOG_INTERVAL (default: 10)" in text
    assert "SDP4BIT_CACHE" in text and "dataset index files" in text


def test_an_unknown_tokenizer_type_is_refused_at_parse():
    """Before: after the process group and the data checks (set-up)."""
    with pytest.raises(ArgumentError, match="argument --tokenizer-type: invalid choice: 'GPT2'"):
        parse_args(["--data-path", "data/x_text_document", "--tokenizer-type", "GPT2"])
