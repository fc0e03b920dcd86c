"""Data and cache mistakes through the driver's command line (issue 28, items 5-7).

Each case runs ``python -m megatron_sdp4bit.pretrain`` as a user would and checks
the one line it prints, and that the fix the line suggests works when followed.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatron_sdp4bit.data.corpus import load_default_corpus_tokenizer, prepare_default_corpus
from megatron_sdp4bit.data.indexed_files import write_indexed_dataset
from megatron_sdp4bit.training.metrics import read_metrics

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "1", "--log-interval", "1",
        "--no-progress-bar"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache with the 1 MiB embedded corpus built (as ``--default-corpus-mb 1`` finds it)."""
    folder = str(tmp_path_factory.mktemp("cache"))
    prepare_default_corpus(cache_dir=folder, max_mb=1)
    return folder


@pytest.fixture(scope="module")
def corpus_tokenizer(cache):
    """(the 1 MiB corpus's tokenizer, its tokenizer.json)."""
    tokenizer = load_default_corpus_tokenizer(prepare_default_corpus(cache_dir=cache, max_mb=1))
    return tokenizer, tokenizer.source


def _cli(tmp_path, env_changes, *argv, drop=("RANK",)):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **env_changes)
    for name in drop:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "megatron_sdp4bit.pretrain", *TINY, *argv,
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)


def _one_error_line(done) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [l for l in done.stderr.splitlines() if l.startswith("sdp4bit-pretrain:")]
    return line


def _documents(tokenizer, count, tokens_each):
    ids = [i for i in range(1, tokenizer.vocab_size) if i != tokenizer.eod]
    return [[ids[(d * 31 + j) % len(ids)] for j in range(tokens_each - 1)] + [tokenizer.eod]
            for d in range(count)]


def test_data_of_another_vocabulary_is_refused_naming_both(tmp_path, cache):
    """Before: ``IndexError: index out of range in self`` at the first step (a device-side
    assert on a GPU). The embedded corpus (8192 ids) read with a 300-id tokenizer."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello world " * 50] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(tmp_path / "tokenizer.json"))
    corpus = prepare_default_corpus(cache_dir=cache, max_mb=1)
    done = _cli(tmp_path, {"SDP4BIT_CACHE": cache}, "--data-path", corpus, "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path), "--train-iters", "2")
    line = _one_error_line(done)
    vocab = backend.get_vocab_size()
    assert re.search(rf"{re.escape(corpus)}\.bin holds token id \d+, outside the vocabulary of the tokenizer "
                     rf"\(HuggingFaceTokenizer from .*tokenizer\.json: {vocab} ids, 0-{vocab - 1}\)", line), line
    assert "iter " not in done.stdout


def test_data_of_another_tokenizer_whose_ids_fit_is_warned(tmp_path, cache, corpus_tokenizer):
    """The embedded corpus (EOD id 0 ends every document) read with a tokenizer of the same
    size whose end-of-document token is another: trained silently before."""
    import json
    import shutil

    tokenizer, tokenizer_json = corpus_tokenizer
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(tokenizer_json, other / "tokenizer.json")
    eos = next(t for t, i in sorted(tokenizer.vocab.items(), key=lambda item: item[1]) if i > 300)
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    corpus = prepare_default_corpus(cache_dir=cache, max_mb=1)
    done = _cli(tmp_path, {"SDP4BIT_CACHE": cache}, "--data-path", corpus, "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", str(other), "--train-iters", "1", "--eval-iters", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [l for l in done.stdout.splitlines() if l.startswith("warning: all")]
    assert f"end with token id 0, not the end-of-document id {tokenizer.vocab[eos]}" in warning


def test_a_split_without_validation_trains_without_evaluating_and_says_so(tmp_path, cache):
    """Before: ``--split 1,0,0`` (as the driver's own message suggested) with evaluation
    on (the default --eval-iters 5): ``TypeError: object of type 'NoneType' has no len()``."""
    done = _cli(tmp_path, {"SDP4BIT_CACHE": cache}, "--default-corpus-mb", "1", "--split", "1,0,0",
                "--train-iters", "2", "--eval-interval", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "evaluation: off, --split 1,0,0 gives the validation set weight 0" in done.stdout
    assert "final valid loss    not evaluated (--split 1,0,0 gives the validation set weight 0)" in done.stdout
    assert not [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "valid"]


def test_a_validation_set_without_a_document_suggests_a_split_that_works(tmp_path, cache, corpus_tokenizer):
    tokenizer, tokenizer_json = corpus_tokenizer
    prefix = str(tmp_path / "five_text_document")
    write_indexed_dataset(prefix, _documents(tokenizer, 5, 200), tokenizer.vocab_size)
    data = ["--data-path", prefix, "--tokenizer-type", "StdlibBPETokenizer", "--tokenizer-model", tokenizer_json,
            "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1"]
    wrong_tokenizer = ["--data-path", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "nope.json",
                       "--merge-file", "nope.txt"]  # two mistakes: the missing file is named first
    line = _one_error_line(_cli(tmp_path, {"SDP4BIT_CACHE": cache}, *wrong_tokenizer))
    assert line.endswith("error: GPT2BPETokenizer vocab file not found: nope.json (check --vocab-file).")
    line = _one_error_line(_cli(tmp_path, {"SDP4BIT_CACHE": cache}, *data))
    assert "--split 969,30,1 gives the validation set no document of" in line and "(5 documents)" in line
    suggested = re.search(r"\(--split (\S+) gives it a document\)", line).group(1)
    assert "--eval-iters 0" in line
    done = _cli(tmp_path, {"SDP4BIT_CACHE": cache}, *data, "--split", suggested)
    assert done.returncode == 0, done.stderr[-3000:]
    (valid,) = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["kind"] == "valid"]
    assert valid["loss"] > 0


def test_a_corpus_smaller_than_one_sample_is_refused_and_many_epochs_are_warned(tmp_path, cache, corpus_tokenizer):
    """Before: 12 tokens trained silently on copies of themselves, hundreds of epochs."""
    tokenizer, tokenizer_json = corpus_tokenizer
    prefix = str(tmp_path / "tiny_text_document")
    write_indexed_dataset(prefix, _documents(tokenizer, 2, 6), tokenizer.vocab_size)  # 12 tokens
    data = ["--data-path", prefix, "--tokenizer-type", "StdlibBPETokenizer", "--tokenizer-model", tokenizer_json,
            "--split", "1,0,0", "--train-iters", "10"]
    line = _one_error_line(_cli(tmp_path, {"SDP4BIT_CACHE": cache}, *data))
    assert "the training set of" in line and "holds 12 tokens, fewer than one sample of --seq-length 16" in line
    seq = re.search(r"--seq-length of at most (\d+)", line).group(1)
    done = _cli(tmp_path, {"SDP4BIT_CACHE": cache}, *data, "--seq-length", seq)
    assert done.returncode == 0, done.stderr[-3000:]
    (warning,) = [l for l in done.stdout.splitlines() if l.startswith("warning: the run reads the training set")]
    assert re.search(r"reads the training set of .*tiny_text_document 9\.2 times \(epochs\): 10 samples of "
                     r"--seq-length 11 from its 12 tokens", warning), warning
    assert "--train-iters 4 reads it at most 4 times" in warning


def _mount_read_only(folder) -> str:
    """'' when a read-only tmpfs is mounted on ``folder``, else why not."""
    os.makedirs(folder, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


@pytest.mark.parametrize("home_kind", ["read-only mount", ".cache is a file"])
def test_an_unwritable_home_cache_is_named_with_sdp4bit_cache(tmp_path, cache, home_kind):
    """Before: an ``OSError`` traceback from the driver (and the preprocessor), saying
    neither what the folder is nor that ``SDP4BIT_CACHE`` moves it."""
    home = tmp_path / "home"
    if home_kind == "read-only mount":
        why = _mount_read_only(home)
        if why:
            pytest.skip(f"cannot mount a read-only tmpfs here ({why}): the real read-only HOME is not tested")
    else:
        home.mkdir()
        (home / ".cache").write_text("not a folder")
    try:
        done = _cli(tmp_path, {"HOME": str(home)}, "--default-corpus-mb", "1", "--train-iters", "1",
                    drop=("RANK", "SDP4BIT_CACHE"))
        line = _one_error_line(done)
        folder = os.path.join(str(home), ".cache", "megatron_sdp4bit")
        assert re.search(rf"cannot write {re.escape(folder)} \(.+\): it is megatron_sdp4bit's cache of the "
                         r"embedded corpus, its tokenizer and the dataset index files; set SDP4BIT_CACHE to a "
                         r"writable folder", line), line
        preprocess = subprocess.run(
            [sys.executable, "-m", "megatron_sdp4bit.data.preprocess", "--input", __file__,
             "--output-prefix", str(tmp_path / "out")], capture_output=True, text=True, timeout=600,
            env={k: v for k, v in dict(os.environ, HOME=str(home)).items() if k != "SDP4BIT_CACHE"})
        assert preprocess.returncode == 2 and "Traceback" not in preprocess.stderr, preprocess.stderr[-2000:]
        assert f"cannot write {folder}" in preprocess.stderr and "SDP4BIT_CACHE" in preprocess.stderr
        done = _cli(tmp_path, {"HOME": str(home), "SDP4BIT_CACHE": cache}, "--default-corpus-mb", "1",
                    "--train-iters", "1", "--eval-iters", "0")
        assert done.returncode == 0, done.stderr[-3000:]  # the fix the line names works
    finally:
        if home_kind == "read-only mount":
            subprocess.run(["umount", str(home)], capture_output=True)
