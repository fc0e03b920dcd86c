"""Preprocessing round trip: what lands in .bin/.idx is exactly the reference
tokenization of each document (+ EOD), and decodes back to the text."""
import os
import subprocess
import sys

import numpy
import pytest
import tokenizers

from megatron_sdp4bit.data.preprocess import main, preprocess
from megatron_sdp4bit.data.tokenizer_types import TokenizerSpec

from data_samples import SAMPLE_DOCUMENTS, read_indexed


def reference_ids(tokenizer_type, files, doc):
    """The tokenization a user of the `tokenizers` library would compute directly."""
    if tokenizer_type == "GPT2BPETokenizer":
        vocab, merges = files
        return tokenizers.ByteLevelBPETokenizer(vocab, merges).encode(doc).ids
    return tokenizers.Tokenizer.from_file(files).encode(doc, add_special_tokens=False).ids


@pytest.fixture(params=["StdlibBPETokenizer", "GPT2BPETokenizer"])
def tokenizer_case(request, small_corpus_prefix, gpt2_files):
    if request.param == "GPT2BPETokenizer":
        vocab, merges = gpt2_files
        return TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges), gpt2_files
    model = os.path.join(os.path.dirname(small_corpus_prefix), "tokenizer.json")
    return TokenizerSpec("StdlibBPETokenizer", tokenizer_model=model), model


@pytest.mark.parametrize("append_eod", [True, False])
@pytest.mark.parametrize("input_kind", ["jsonl", "text"])
def test_round_trip(tmp_path, sample_inputs, tokenizer_case, append_eod, input_kind):
    spec, files = tokenizer_case
    jsonl, text_files = sample_inputs
    inputs = [jsonl] if input_kind == "jsonl" else text_files
    stats = preprocess(inputs, str(tmp_path / "out"), spec, append_eod=append_eod)
    assert stats.prefix == str(tmp_path / "out") + "_text_document"
    documents, dtype = read_indexed(stats.prefix)
    tokenizer = spec.build()
    assert dtype == numpy.uint16  # Megatron-LM's choice for vocabularies < 65500
    assert len(documents) == len(SAMPLE_DOCUMENTS) == stats.documents
    for ids, text in zip(documents, SAMPLE_DOCUMENTS):
        expected = reference_ids(spec.tokenizer_type, files, text)
        if append_eod:
            assert ids[-1] == tokenizer.eod
            ids = ids[:-1]
        assert ids == expected
        assert tokenizer.detokenize(ids) == text
    assert stats.tokens == sum(map(len, read_indexed(stats.prefix)[0]))


def test_gpt2_eod_text_is_not_the_eod_id(gpt2_files):
    vocab, merges = gpt2_files
    tokenizer = TokenizerSpec("GPT2BPETokenizer", vocab, merges).build()
    assert tokenizer.eod == tokenizers.ByteLevelBPETokenizer(vocab, merges).token_to_id("<|endoftext|>")
    assert tokenizer.eod not in tokenizer.tokenize(SAMPLE_DOCUMENTS[5])


def test_megatron_reads_what_we_wrote(tmp_path, sample_inputs, gpt2_files):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    vocab, merges = gpt2_files
    spec = TokenizerSpec("GPT2BPETokenizer", vocab, merges)
    stats = preprocess([sample_inputs[0]], str(tmp_path / "m"), spec, append_eod=True)
    ours, _ = read_indexed(stats.prefix)
    theirs = IndexedDataset(stats.prefix)
    assert len(theirs) == len(ours)
    for i, ids in enumerate(ours):
        assert theirs[i].tolist() == ids


def test_text_document_units_and_empty_documents(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    spec = TokenizerSpec("GPT2BPETokenizer", vocab, merges)
    path = tmp_path / "p.txt"
    path.write_text("first para\nline two\n\n\nsecond para\n\nthird\n", encoding="utf-8")
    tokenizer = spec.build()
    for per, expected in [("paragraph", ["first para\nline two", "second para", "third"]),
                          ("line", ["first para", "line two", "second para", "third"])]:
        stats = preprocess([str(path)], str(tmp_path / per), spec, text_document_per=per)
        documents, _ = read_indexed(stats.prefix)
        assert [tokenizer.detokenize(d) for d in documents] == expected
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": "kept"}\n', encoding="utf-8")
    stats = preprocess([str(empty)], str(tmp_path / "e"), spec, append_eod=True)
    documents, _ = read_indexed(stats.prefix)
    assert [tokenizer.detokenize(d) for d in documents] == ["kept<|endoftext|>"]


def test_workers_give_identical_files(tmp_path, sample_inputs, gpt2_files):
    vocab, merges = gpt2_files
    spec = TokenizerSpec("GPT2BPETokenizer", vocab, merges)
    one = preprocess([sample_inputs[0]], str(tmp_path / "w1"), spec, append_eod=True)
    two = preprocess([sample_inputs[0]], str(tmp_path / "w2"), spec, append_eod=True, workers=2)
    for ext in (".bin", ".idx"):
        with open(one.prefix + ext, "rb") as a, open(two.prefix + ext, "rb") as b:
            assert a.read() == b.read()


def test_cli(tmp_path, sample_inputs, gpt2_files, capsys):
    vocab, merges = gpt2_files
    out = str(tmp_path / "cli")
    rc = main(["--input", sample_inputs[0], "--output-prefix", out, "--tokenizer-type",
               "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
               "--append-eod", "--json-keys", "text"])
    assert rc == 0
    assert f"--data-path {out}_text_document" in capsys.readouterr().out
    assert len(read_indexed(out + "_text_document")[0]) == len(SAMPLE_DOCUMENTS)


@pytest.mark.parametrize("argv_tail, message", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "m.txt"], "--vocab-file"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "nope.json", "--merge-file", "m"], "nope.json"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model"),
    (["--json-key", "body"], "no key 'body'"),
])
def test_cli_errors_are_clear(tmp_path, sample_inputs, argv_tail, message, capsys):
    rc = main(["--input", sample_inputs[0], "--output-prefix", str(tmp_path / "x")] + argv_tail)
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(str(tmp_path / "x_text_document.bin"))


def test_missing_input_file(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "absent.jsonl"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "absent.jsonl" in capsys.readouterr().err


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "megatron_sdp4bit.data.preprocess", "--help"],
                            capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0
    for flag in ("--input", "--output-prefix", "--tokenizer-type", "--vocab-file", "--merge-file",
                 "--tokenizer-model", "--append-eod", "--json-key", "--workers"):
        assert flag in result.stdout


def test_non_utf8_text_is_refused_and_leaves_no_output(tmp_path, gpt2_files, capsys):
    vocab, merges = gpt2_files
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    out = str(tmp_path / "o")
    rc = main(["--input", str(bad), "--output-prefix", out, "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", vocab, "--merge-file", merges])
    assert rc == 2 and "latin1.txt is not UTF-8" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["latin1.txt"]


@pytest.mark.parametrize("name, content, words", [
    ("empty.jsonl", b"", "no document in"),
    ("blank.jsonl", b"\n\n{\"text\": \"\"}\n", "no document in"),
    ("notjson.jsonl", b'{"text": "ok"}\nnot json\n', "notjson.jsonl:2 is not valid JSON"),
    ("nokey.jsonl", b'{"body": "x"}\n', "nokey.jsonl:1 has no key 'text'; pass the right --json-key"),
    ("list.jsonl", b"[1, 2]\n", "list.jsonl:1 has no key 'text'"),
    ("null.jsonl", b'{"text": null}\n', "null.jsonl:1: 'text' holds a NoneType, not text"),
    ("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "latin1.jsonl:2 is not UTF-8 text"),
    ("latin1.txt", b"caf\xe9", "latin1.txt is not UTF-8 text"),
])
def test_bad_input_is_one_line_naming_the_file_and_line_and_writes_nothing(tmp_path, gpt2_files, capsys,
                                                                            name, content, words):
    """Before: an empty input wrote a pair of files with 0 documents and said "use it with
    --data-path"; a non-UTF-8 JSONL line was a codec error naming no file."""
    vocab, merges = gpt2_files
    (tmp_path / name).write_bytes(content)
    rc = main(["--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "out" / "o"),
               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sdp4bit-preprocess: error: "), err
    assert words in err[0]
    assert not list((tmp_path / "out").glob("o_*")) if (tmp_path / "out").exists() else True


def test_the_output_folder_is_made_or_its_failure_named(tmp_path, gpt2_files, capsys):
    vocab, merges = gpt2_files
    (tmp_path / "doc.txt").write_text("some text")
    common = ["--input", str(tmp_path / "doc.txt"), "--tokenizer-type", "GPT2BPETokenizer",
              "--vocab-file", vocab, "--merge-file", merges]
    assert main(common + ["--output-prefix", str(tmp_path / "new" / "deeper" / "o")]) == 0
    assert (tmp_path / "new" / "deeper" / "o_text_document.bin").is_file()
    (tmp_path / "a_file").write_text("x")
    assert main(common + ["--output-prefix", str(tmp_path / "a_file" / "o")]) == 2
    err = capsys.readouterr().err
    assert f"cannot create the folder of --output-prefix {tmp_path / 'a_file' / 'o'}: {tmp_path / 'a_file'} " \
        "(a file of that name is in the way)" in err


def test_eod_token_is_checked_for_the_default_tokenizer(small_corpus_prefix, monkeypatch):
    """Before: ``--eod-token`` was ignored with the default tokenizer."""
    from megatron_sdp4bit.data import tokenizer_types
    from megatron_sdp4bit.data.corpus import load_default_corpus_tokenizer

    # the 1 MiB corpus's tokenizer stands in for the whole stdlib's (built in a minute)
    monkeypatch.setattr(tokenizer_types, "default_tokenizer",
                        lambda cache_dir=None: load_default_corpus_tokenizer(small_corpus_prefix))
    with pytest.raises(ValueError, match="'zzz' is not in its vocabulary"):
        tokenizer_types.build_tokenizer("StdlibBPETokenizer", eod_token="zzz")
    assert tokenizer_types.build_tokenizer("StdlibBPETokenizer", eod_token="<|endoftext|>").eod == 0


def test_an_input_without_documents_keeps_the_dataset_already_at_the_prefix(tmp_path, gpt2_files, capsys):
    """Issue 28, round two: an empty input given the prefix of an earlier dataset (a
    mistyped --input, a file still being written) said "nothing was written", but had
    replaced that dataset's files with its own and then removed them."""
    vocab, merges = gpt2_files
    (tmp_path / "doc.txt").write_text("some text to keep")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    common = ["--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
              "--vocab-file", vocab, "--merge-file", merges]
    assert main(["--input", str(tmp_path / "doc.txt")] + common) == 0
    before = {ext: (tmp_path / f"o_text_document{ext}").read_bytes() for ext in (".bin", ".idx")}
    assert main(["--input", str(tmp_path / "empty.jsonl")] + common) == 2
    assert "nothing was written" in capsys.readouterr().err
    assert {ext: (tmp_path / f"o_text_document{ext}").read_bytes() for ext in (".bin", ".idx")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt", "empty.jsonl", "o_text_document.bin",
                                                          "o_text_document.idx"]


def test_the_suggested_driver_flags_read_the_data_back(tmp_path, gpt2_files, capsys):
    """The line the preprocessor ends with is the driver's data flags: before, it was
    ``--data-path PREFIX`` alone, which the driver refuses (it needs --tokenizer-type),
    unquoted, so a folder with a space split into two prefixes."""
    import shlex

    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.datasets import _tokenizer_and_prefixes

    vocab, merges = gpt2_files
    folder = tmp_path / "my data"
    folder.mkdir()
    (folder / "doc.txt").write_text("some text")
    assert main(["--input", str(folder / "doc.txt"), "--output-prefix", str(folder / "o"),
                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("use it with: --data-path ")
    args = parse_args(shlex.split(line[len("use it with: "):]))
    tokenizer, prefixes = _tokenizer_and_prefixes(args)
    assert prefixes == [str(folder / "o_text_document")]
    assert tokenizer.tokenize("some text") == read_indexed(prefixes[0])[0][0]


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_is_one_line_and_leaves_no_files(tmp_path, small_corpus_prefix, workers):
    """Issue 28, round two: Ctrl-C printed ``KeyboardInterrupt``'s traceback (with
    --workers, one per worker too). Now one line, exit 130, and neither the pair of
    files nor their temporary names are left (an earlier dataset there stays)."""
    import random
    import signal
    import time

    words = "the quick brown fox jumps over a lazy dog while python code runs".split()
    rng = random.Random(0)
    big = tmp_path / "big.jsonl"
    big.write_text("".join('{"text": "%s"}\n' % " ".join(rng.choice(words) for _ in range(300))
                           for _ in range(30000)))
    model = os.path.join(os.path.dirname(small_corpus_prefix), "tokenizer.json")
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_sdp4bit.data.preprocess", "--input", str(big),
                             "--output-prefix", str(out), "--tokenizer-model", model, "--workers", str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "o_text_document.bin.tmp").exists():  # encoding has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    # as a terminal's Ctrl-C does: to the whole group, workers included, which may still be
    # starting (one half-started printed an EOFError traceback)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip() == f"sdp4bit-preprocess: interrupted (Ctrl-C): nothing was written to {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_an_empty_output_prefix_is_refused(tmp_path, capsys, monkeypatch):
    """``--output-prefix "$OUT"`` with OUT unset wrote ``_text_document.bin/.idx`` into the
    working directory (issue 28, round two)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("some text")
    assert main(["--input", "doc.txt", "--output-prefix", ""]) == 2
    assert capsys.readouterr().err.strip() == ("sdp4bit-preprocess: error: --output-prefix was given an empty path "
                                               "(an empty variable?): pass where the data goes, e.g. data/my")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]
