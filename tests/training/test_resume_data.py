"""A resume that would train on other samples is refused, by one rule (issue 28 item 4).

Another ``--seq-length``, ``--split``, ``--data-path`` or corpus size used to read other
samples at the resumed position, silently, while another ``--seed`` was refused for
that very reason. Now a checkpoint records everything that decides which training
samples a run reads (``training/checkpoint/training_data.py``) and a resume that
differs is refused in one line naming each flag, both values and the fix; the same
corpus under another path resumes. One forked world of 2 gloo ranks (the plain
optimizer: the rule does not depend on it), then the rule on records alone.

Found on the way, the same for the model: another ``--num-attention-heads`` (the
same parameter shapes) resumed silently on another model; another ``--hidden-size``
died on torch's size-mismatch traceback (plain optimizer). A checkpoint records the
flags that shape its model (``training/checkpoint/model_record.py``) and another is
refused in one line; one saved before that names the first key or shape that differs.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest

from driver_runs import TINY_GPT, captured_run, driver_world, train_log
from megatron_sdp4bit.training.arguments import parse_args
from megatron_sdp4bit.training.checkpoint import CheckpointError, compare_data
from megatron_sdp4bit.training.setup import set_up

TINY = TINY_GPT + ["--lr-decay-iters", "4"]


def _copies(root) -> str:
    """Rank 0 copies the embedded corpus elsewhere (with its tokenizer) and makes a
    checkpoint of the first run as an older version saved it (no data record);
    returns the copy's prefix."""
    import torch

    from megatron_sdp4bit.data import prepare_default_corpus

    prefix = prepare_default_corpus(max_mb=1)
    moved = os.path.join(root, "moved")
    if torch.distributed.get_rank() == 0:
        shutil.copytree(os.path.dirname(prefix), moved)
        shutil.copytree(os.path.join(root, "ck"), os.path.join(root, "ck_old"))
        path = os.path.join(root, "ck_old", "iter_0000002", "manifest.json")
        manifest = json.load(open(path))
        data = manifest["layout"].pop("data")
        del manifest["layout"]["model"]
        manifest["layout"].update(seed=data["seed"], global_batch_size=data["global_batch_size"])
        json.dump(manifest, open(path, "w"))
    torch.distributed.barrier()
    return os.path.join(moved, os.path.basename(prefix))


def _world(rank, world_size, root):
    def go(name, flags):
        return captured_run(TINY + ["--run-dir", os.path.join(root, name)] + flags)

    load = ["--train-iters", "4", "--load", os.path.join(root, "ck")]
    out = {"first": go("first", ["--train-iters", "2", "--save", os.path.join(root, "ck")])}
    moved = _copies(root)
    as_data_path = ["--data-path", moved, "--tokenizer-type", "StdlibBPETokenizer",
                    "--tokenizer-model", os.path.join(os.path.dirname(moved), "tokenizer.json")]
    out.update({
        "same": go("same", load),
        "moved": go("moved", load + as_data_path + ["--split", "9,0.5,0.5"]),
        "seq_length": go("seq_length", load + ["--seq-length", "64"]),
        "split": go("split", load + ["--split", "80,20,0"]),
        "corpus": go("corpus", load + ["--default-corpus-mb", "2"]),
        "seed": go("seed", load + ["--seed", "7"]),
        "global_batch": go("global_batch", load + ["--global-batch-size", "16"]),
        "tokenizer": go("tokenizer", load + ["--data-path", moved, "--tokenizer-type", "HuggingFaceTokenizer",
                                             "--tokenizer-model", os.path.dirname(moved)]),
        "several": go("several", load + ["--seq-length", "64", "--split", "80,20,0"]),
        "old": go("old", ["--train-iters", "4", "--load", os.path.join(root, "ck_old")]),
        "old_seed": go("old_seed", ["--train-iters", "4", "--load", os.path.join(root, "ck_old"), "--seed", "7"]),
        "heads": go("heads", load + ["--num-attention-heads", "2"]),
        "shape": go("shape", load + ["--hidden-size", "64", "--num-layers", "2", "--untie-embeddings-and-output-weights"]),
        "old_shape": go("old_shape", ["--train-iters", "4", "--load", os.path.join(root, "ck_old"),
                                      "--hidden-size", "64"]),
        # set up (and resumed) only: 3000 iterations would take minutes here
        "epochs": _set_up_only(TINY + ["--run-dir", os.path.join(root, "epochs"), "--train-iters", "3000",
                                       "--load", os.path.join(root, "ck")]),
    })
    return out


def _set_up_only(argv: list) -> dict:
    """The driver's set-up alone, the resume included, its printout captured."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        set_up(parse_args(argv)).release()
    return {"stdout": text.getvalue()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return driver_world(tmp_path_factory, "data", _world, 2, timeout_s=600)


def _refused(world, case: str, differences: str, fix: str) -> None:
    """Refused alike on every rank, in one line, before anything trained."""
    root, results = world
    line = (f"checkpoint {os.path.join(root, 'ck', 'iter_0000002')} was saved with {differences}: this run "
            f"would train on other samples than the run it continues; resume with {fix}")
    for result in results:
        assert result[case]["error"] == line
        assert "resumed" not in result[case]["stdout"] and "iter " not in result[case]["stdout"]


def test_the_same_data_resumes_and_so_does_a_copy_of_the_corpus_elsewhere(world):
    """The corpus is known by its documents and tokens, not its path; a split that gives
    the training set the same share trains on the same samples (9,0.5,0.5 = 90,10,0)."""
    root, results = world
    for case in ("same", "moved"):
        assert results[0][case]["error"] is None, results[0][case]["error"]
        assert "warning:" not in results[0][case]["stdout"]
    assert train_log(root, "moved") == train_log(root, "same") and sorted(train_log(root, "same")) == [3, 4]


@pytest.mark.parametrize("case, differences, fix", [
    ("seq_length", "--seq-length 32 (this run: 64)", "--seq-length 32"),
    ("split", "--split 90,10,0 (this run: 80,20,0)", "--split 90,10,0"),
    ("seed", "--seed 1234 (this run: 7)", "--seed 1234"),
    ("global_batch", "--global-batch-size 8 (this run: 16; without --global-batch-size it is --micro-batch-size "
                     "x data-parallel size)", "--global-batch-size 8"),
    ("several", "--seq-length 32 (this run: 64), --split 90,10,0 (this run: 80,20,0)",
     "--seq-length 32 --split 90,10,0"),
])
def test_another_data_flag_is_refused_naming_both_values(world, case, differences, fix):
    """Before: --seq-length, --split resumed on other samples, silently; --seed and the
    global batch size were refused by rules of their own."""
    _refused(world, case, differences, fix)


def _counts(root, run_dir: str) -> str:
    """The corpus of the run in ``run_dir`` in words (the embedded corpus is this Python's
    standard library: its size depends on the release)."""
    from megatron_sdp4bit.data import prepare_default_corpus
    from megatron_sdp4bit.data.indexed_files import check_indexed_prefix

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP4BIT_CACHE", os.path.join(root, "cache"))
        info = check_indexed_prefix(prepare_default_corpus(max_mb={"first": 1, "corpus": 2}[run_dir]))
    return f"{info.num_documents} documents, {info.num_tokens} tokens"


def test_another_corpus_or_tokenizer_is_refused(world):
    """Before: --default-corpus-mb 2 resumed on another corpus, silently."""
    root, results = world
    _refused(world, "corpus", f"--default-corpus-mb 1 [{_counts(root, 'first')}] (this run: --default-corpus-mb 2 "
                              f"[{_counts(root, 'corpus')}])", "--default-corpus-mb 1")
    assert "--tokenizer-type StdlibBPETokenizer (vocabulary " in results[0]["tokenizer"]["error"]
    assert "(this run: HuggingFaceTokenizer (vocabulary " in results[0]["tokenizer"]["error"]
    assert results[0]["tokenizer"]["error"].endswith("resume with --tokenizer-type StdlibBPETokenizer and its files")


def test_a_train_iters_that_reorders_the_epochs_is_said_in_one_warning(world):
    """3000 iterations of 8 samples need 4 epochs of the 1 MiB corpus, 2 iterations one:
    megatron shuffles the epochs of a training set together, so every sample moved.
    Not refused (a run may have to end elsewhere than it was started for), but said.
    Before: resumed on those other samples, silently."""
    root, results = world
    ck = os.path.join(root, "ck", "iter_0000002")
    line = (f"warning: checkpoint {ck} was saved with --train-iters 2 (this run: 3000), and this run's training "
            "set holds another number of epochs of the corpus: megatron shuffles all the epochs of a set together, "
            "so the samples before iteration 2 are others than those it trained on and this run goes on in the new "
            "order (some samples again, some never); resume with --train-iters 2 to keep its order")
    stdout = results[0]["epochs"]["stdout"]
    assert [row for row in stdout.splitlines() if row.startswith("warning:")] == [line]
    assert f"resumed from {os.path.join(root, 'ck')} at iteration 2" in stdout


def test_a_checkpoint_without_the_record_loads_with_one_warning(world):
    """Its seed and global batch size were recorded before: still compared."""
    root, results = world
    assert results[0]["old"]["error"] is None, results[0]["old"]["error"]
    warnings = [line for line in results[0]["old"]["stdout"].splitlines() if line.startswith("warning")]
    assert warnings == [f"warning: checkpoint {os.path.join(root, 'ck_old', 'iter_0000002')} records no data "
                        "settings (saved by an older version): --seq-length, --data-path, --split, the corpus "
                        "and the tokenizer are not checked; resume with the ones it was saved with"]
    assert train_log(root, "old") == train_log(root, "same")
    assert "--seed 1234 (this run: 7)" in results[0]["old_seed"]["error"]


def test_another_model_is_refused_naming_each_flag(world):
    """Before: --num-attention-heads 2 resumed a 4-head checkpoint silently (the same
    shapes); --hidden-size 64 died on torch's size-mismatch traceback."""
    root, results = world
    ck = os.path.join(root, "ck", "iter_0000002")
    lines = {
        "heads": f"checkpoint {ck} was saved with --num-attention-heads 4 (this run: 2): another model; resume with "
                 "--num-attention-heads 4",
        "shape": f"checkpoint {ck} was saved with --num-layers 1 (this run: 2), --hidden-size 32 (this run: 64), "
                 "--ffn-hidden-size 128 (this run: 256), no --untie-embeddings-and-output-weights (this run: "
                 "--untie-embeddings-and-output-weights): another model; resume with --num-layers 1 --hidden-size 32 "
                 "--ffn-hidden-size 128 and without --untie-embeddings-and-output-weights",
    }
    for result in results:
        for case, line in lines.items():
            assert result[case]["error"] == line
            assert "resumed" not in result[case]["stdout"]
    old = results[0]["old_shape"]["error"]
    assert old.startswith(f"checkpoint {os.path.join(root, 'ck_old', 'iter_0000002')} holds another model than "
                          "this run builds (size mismatch for ") and "\n" not in old
    assert old.endswith("resume with the model flags it was saved with (--num-layers, --hidden-size, "
                        "--transformer-impl, ...)")


# --- the rule on records ----------------------------------------------------------------------

RECORD = {"seed": 1234, "seq_length": 32, "global_batch_size": 8, "split": "90,10,0", "data_path": None,
          "default_corpus_mb": 1, "corpus": [[49, 247430]], "weights": None,
          "tokenizer": ["StdlibBPETokenizer", 4096], "train_samples": 32,
          "samples": {"first": 8, "count": 8, "sha256": "a" * 64}}


def _compare(then: dict, **now):
    return compare_data("ck/iter_0000002", {"data": then}, {**RECORD, **now})


def test_blends_paths_and_digests_on_records():
    assert _compare(RECORD) == []
    assert _compare(RECORD, data_path=["/elsewhere/corpus"], default_corpus_mb=None) == []  # the same corpus
    blend = {**RECORD, "data_path": ["0.3", "a", "0.7", "b"], "corpus": [[10, 100], [20, 200]], "weights": [0.3, 0.7]}
    with pytest.raises(CheckpointError, match=r"saved with --data-path 0.3 a 0.7 b \[10 documents, 100 tokens; 20 "
                                              r"documents, 200 tokens\] \(this run: --data-path 0.5 a 0.5 b"):
        _compare(blend, **{**blend, "data_path": ["0.5", "a", "0.5", "b"], "weights": [0.5, 0.5]})
    assert _compare(blend, **{**blend, "data_path": ["3", "a", "7", "b"], "weights": [3.0, 7.0]}) == []
    with pytest.raises(CheckpointError, match=r"resume with --data-path a with the corpus files it was saved with$"):
        _compare({**RECORD, "data_path": ["a"]}, data_path=["a"], corpus=[[50, 247431]])
    with pytest.raises(CheckpointError, match=r"resume with --default-corpus-mb 1 \(and without --data-path\)$"):
        _compare(RECORD, data_path=["a"], default_corpus_mb=None, corpus=[[50, 1]])
    with pytest.raises(CheckpointError, match=r"resume with --data-path 'my data/a' 'b c'$"):  # a shell's words
        _compare({**RECORD, "data_path": ["my data/a", "b c"], "corpus": [[10, 100], [20, 200]]},
                 data_path=["b c", "my data/a"], corpus=[[20, 200], [10, 100]])
    with pytest.raises(CheckpointError, match="the corpus files changed since it was saved"):
        _compare(RECORD, samples={**RECORD["samples"], "sha256": "b" * 64})
    (warning,) = _compare(RECORD, samples={**RECORD["samples"], "sha256": "b" * 64}, train_samples=64)
    assert warning.startswith("warning: checkpoint ck/iter_0000002 was saved with --train-iters 4 (this run: 8), ")
    # a record with nothing of the data (a checkpoint without a manifest): nothing compared, no warning
    assert compare_data("ck", {"data": {}}, {**RECORD, "seed": 7}) == []
    assert compare_data("ck", {"data": RECORD}, None) == []  # a caller without a record compares nothing
