"""Flags that name files and folders, as a new user writes them (issue 28, round two):
an empty ``--data-path``, ``~`` that no shell expanded, tokenizer files nothing reads.
Each was accepted and then ignored or taken literally; now it is what the user meant,
or one line saying what to change. In-process: parsing imports no megatron, and the
data checks below refuse before any collective."""
from __future__ import annotations

import pytest

from megatron_sdp4bit.data.preprocess import main as preprocess_main
from megatron_sdp4bit.data.tokenizer_types import build_tokenizer
from megatron_sdp4bit.training.arguments import ArgumentError, parse_args
from megatron_sdp4bit.training.datasets import _tokenizer_and_prefixes


def test_an_empty_data_path_is_refused_rather_than_the_embedded_corpus_trained():
    """``--data-path $DATA`` with DATA unset: before, the run trained on the embedded
    corpus (Python's standard library) without a word about the data it was meant for."""
    with pytest.raises(ArgumentError, match=r"^--data-path was given no prefix \(an empty variable\?\): pass the "
                       r"prefix .* or drop --data-path to train on the embedded corpus$"):
        parse_args(["--data-path", "--tokenizer-type", "GPT2BPETokenizer"])
    assert parse_args([]).data_path is None  # without the flag: the embedded corpus


@pytest.mark.parametrize("argv, flag", [
    (["--save", ""], "--save"), (["--load="], "--load"), (["--run-dir", ""], "--run-dir"),
    (["--data-path", "1", "", "--tokenizer-type", "GPT2BPETokenizer"], "--data-path"),
    (["--vocab-file", ""], "--vocab-file"), (["--tensorboard-dir", ""], "--tensorboard-dir"),
])
def test_an_empty_path_is_refused_rather_than_taken_as_no_flag(argv, flag):
    """``--save "$CKPT"`` with CKPT unset: before, the run trained and saved nothing, and
    ``--load ""`` started from scratch, both without a word (an empty string was taken
    as the flag's absence)."""
    with pytest.raises(ArgumentError) as refused:
        parse_args(argv)
    assert str(refused.value) == (f"{flag} was given an empty path (an empty variable?): pass the path, or "
                                  f"drop {flag}")
    with pytest.raises(ArgumentError, match=r"^--config was given an empty path \(an empty variable\?\)"):
        parse_args(["--config", ""])


def test_a_home_folder_no_shell_expanded_is_the_home_folder(tmp_path, monkeypatch):
    """Before: ``save: ~/ck`` in a config file (or ``--save=~/ck``, or quoted) saved into a
    folder named ``~`` in the working directory, where ``--load ~/ck`` never looked."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = str(tmp_path / "home")
    config = tmp_path / "home" / "run.yaml"
    config.parent.mkdir()
    config.write_text("save: ~/ck\ndata_path: [0.3, ~/a_text_document, 0.7, ~/b_text_document]\n"
                      "tokenizer_type: GPT2BPETokenizer\nvocab_file: ~/vocab.json\nmerge_file: ~/merges.txt\n")
    args = parse_args(["--config", "~/run.yaml", "--load=~/ck", "--run-dir", "~/runs/1"])
    assert args.save == args.load == f"{home}/ck"
    assert args.data_path == ["0.3", f"{home}/a_text_document", "0.7", f"{home}/b_text_document"]
    assert (args.vocab_file, args.merge_file, args.run_dir) == (f"{home}/vocab.json", f"{home}/merges.txt",
                                                                f"{home}/runs/1")
    assert parse_args(["--save", "ck~/x"]).save == "ck~/x"  # only a leading ~ is the home folder


@pytest.mark.parametrize("argv, line", [
    (["--vocab-file", "gpt2-vocab.json"], "--vocab-file needs --data-path (without it the run trains on the "
     "embedded corpus, which has its own tokenizer)"),
    (["--tokenizer-model", "tok.json"], "--tokenizer-model needs --data-path"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --data-path"),
])
def test_tokenizer_files_without_data_are_refused(argv, line):
    """Before: ``--vocab-file`` or ``--tokenizer-model`` without ``--data-path`` was ignored:
    the run trained on the embedded corpus with its own tokenizer."""
    with pytest.raises(ArgumentError, match="^" + line.replace("(", r"\(").replace(")", r"\)")):
        _tokenizer_and_prefixes(parse_args(argv))


@pytest.mark.parametrize("tokenizer_type, files, line", [
    ("StdlibBPETokenizer", {"vocab_file": "v.json", "merge_file": "m.txt"},
     "--tokenizer-type StdlibBPETokenizer reads --tokenizer-model, not --vocab-file or --merge-file: drop them, "
     "or pass --tokenizer-type GPT2BPETokenizer, which reads them"),
    ("GPT2BPETokenizer", {"vocab_file": "v.json", "merge_file": "m.txt", "tokenizer_model": "t.json"},
     "--tokenizer-type GPT2BPETokenizer reads --vocab-file and --merge-file, not --tokenizer-model: drop it, "
     "or pass --tokenizer-type HuggingFaceTokenizer, which reads it"),
    ("HuggingFaceTokenizer", {"vocab_file": "v.json", "tokenizer_model": "t.json"},
     "--tokenizer-type HuggingFaceTokenizer reads --tokenizer-model, not --vocab-file: drop it, "
     "or pass --tokenizer-type GPT2BPETokenizer, which reads it"),
])
def test_a_tokenizer_file_the_type_does_not_read_is_refused(tokenizer_type, files, line):
    """One rule for the driver and the preprocessor (``build_tokenizer``), checked before
    any file is opened."""
    with pytest.raises(ValueError) as refused:
        build_tokenizer(tokenizer_type, **files)
    assert str(refused.value) == line


def test_the_preprocessor_no_longer_tokenizes_with_another_tokenizer_than_the_files_named(tmp_path, capsys):
    """Before: ``sdp4bit-preprocess --vocab-file V --merge-file M`` without
    ``--tokenizer-type GPT2BPETokenizer`` tokenized with the default tokenizer, silently,
    and the data then failed (or trained wrong) with the GPT-2 vocabulary."""
    (tmp_path / "doc.txt").write_text("some text")
    assert preprocess_main(["--input", str(tmp_path / "doc.txt"), "--output-prefix", str(tmp_path / "o"),
                            "--vocab-file", "v.json", "--merge-file", "m.txt"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sdp4bit-preprocess: error: --tokenizer-type StdlibBPETokenizer reads --tokenizer-model, not --vocab-file "
        "or --merge-file: drop them, or pass --tokenizer-type GPT2BPETokenizer, which reads them")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]
