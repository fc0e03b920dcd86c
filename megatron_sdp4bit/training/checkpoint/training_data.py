"""What decides which training samples a run reads, as a checkpoint records it, and
the one rule that refuses a resume that would read others.

A resume continues at sample ``iteration x global batch size`` of the training set
megatron builds from the seed (its shuffle), the sequence length (where samples
begin and end), the data (``--data-path``: prefixes and blend weights, or the
embedded corpus of ``--default-corpus-mb``), the corpus itself (its documents and
tokens), the split, the tokenizer and the global batch size; and from the number
of samples the set is built for (``--train-iters``): megatron shuffles all the
epochs of the corpus a set holds together, so a set of another number of epochs
holds every sample elsewhere. Any of them changed, the resumed run trains on other
samples than the run it continues: some again, some never.

``TrainingData.record(iteration)`` is what a checkpoint's manifest holds (under
``layout["data"]``): those settings and a digest of the last samples trained
before it. ``compare_data`` refuses a resume whose settings differ, in one line
naming each flag with both values and the fix; with the same settings, a digest
that differs is refused when the corpus files changed, and said in one warning
line when this run's ``--train-iters`` builds another number of epochs (a run
that must end elsewhere than planned goes on, knowingly, in the new order).
A checkpoint saved before the record existed loads with one warning line (its
``--seed`` and global batch size, recorded then, are still compared).
"""
from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from typing import Any, List, Optional

from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

from megatron_sdp4bit.data.indexed_files import check_indexed_prefix
from megatron_sdp4bit.training.checkpoint.common import CheckpointError

DIGEST_SAMPLES = 16
"""At most this many of the last samples before a checkpoint are hashed (any other
order of the set moves them, whatever its size)."""

_GLOBAL_BATCH_HINT = "without --global-batch-size it is --micro-batch-size x data-parallel size"


def _corpus(prefixes: List[str]) -> List[List[int]]:
    """[documents, tokens] of each prefix, from its .idx header (O(1))."""
    infos = [check_indexed_prefix(prefix) for prefix in prefixes]
    return [[info.num_documents, info.num_tokens] for info in infos]


def samples_digest(dataset, iteration: int, global_batch_size: int) -> Optional[dict]:
    """SHA-256 of the tokens and labels of the last samples trained before ``iteration``
    (at most ``DIGEST_SAMPLES``); None before the first."""
    end = min(iteration * global_batch_size, len(dataset))
    start = max(0, end - min(global_batch_size, DIGEST_SAMPLES))
    if end <= start:
        return None
    digest = hashlib.sha256()
    for index in range(start, end):
        sample = dataset[index]
        for key in ("tokens", "labels"):
            digest.update(sample[key].contiguous().numpy().tobytes())
    return {"first": start, "count": end - start, "sha256": digest.hexdigest()}


@dataclass(frozen=True)
class TrainingData:
    """The settings that decide this run's training samples, and its training set."""

    settings: dict
    """JSON-ready; see the module docstring."""
    dataset: Any = None

    @classmethod
    def of_run(cls, args, tokenizer, train_ds) -> "TrainingData":
        prefixes, weights = train_ds.config.blend
        return cls(settings={
            "seed": args.seed, "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
            "split": args.split, "data_path": list(args.data_path) if args.data_path else None,
            "default_corpus_mb": None if args.data_path else args.default_corpus_mb,
            "corpus": _corpus(list(prefixes)), "weights": list(weights) if weights else None,
            "tokenizer": [args.tokenizer_type or "StdlibBPETokenizer", int(tokenizer.vocab_size)],
            "train_samples": args.train_iters * args.global_batch_size,
        }, dataset=train_ds)

    def record(self, iteration: int) -> dict:
        """What a checkpoint at ``iteration`` records."""
        samples = (samples_digest(self.dataset, iteration, self.settings["global_batch_size"])
                   if self.dataset is not None else None)
        return {**self.settings, "samples": samples}


# --- the rule ---------------------------------------------------------------------------------

def _data_flags(record: dict) -> str:
    if record.get("data_path"):
        return "--data-path " + " ".join(shlex.quote(str(p)) for p in record["data_path"])  # a path may hold a space
    mb = record.get("default_corpus_mb")
    return f"--default-corpus-mb {mb:g}" if mb is not None else "no --data-path (the whole embedded corpus)"


def _data_fix(then: dict, now: dict) -> str:
    if then.get("data_path") or not now.get("data_path"):
        return _data_flags(then)
    return (f"{_data_flags(then)} (and without --data-path)" if then.get("default_corpus_mb") is not None
            else "no --data-path (the whole embedded corpus)")


def _same_data(then: dict, now: dict) -> bool:
    """The same corpus files, blended alike: their paths may differ (a copy elsewhere)."""
    if "corpus" not in then:
        return True
    return then["corpus"] == now["corpus"] and _shares(then.get("weights")) == _shares(now.get("weights"))


def _shares(weights: Optional[list]) -> Optional[list]:
    """Blend weights as megatron uses them: ``3 a 7 b`` is ``0.3 a 0.7 b``."""
    return None if not weights else [w / sum(weights) for w in weights]


def _train_share(split: str) -> float:
    """The training set's share of every document (the first of ``--split``, normalized):
    all of the split that decides the training samples (``90,10,0`` and ``90,5,5`` train
    on the same documents; their validation sets differ)."""
    return parse_and_normalize_split(split)[0]


def _differences(then: dict, now: dict) -> List[tuple]:
    """(what the checkpoint had, this run's, the flag to resume with) per differing setting."""
    found = []
    for key, flag in (("seed", "--seed"), ("seq_length", "--seq-length")):
        if then.get(key) is not None and then[key] != now[key]:
            found.append((f"{flag} {then[key]}", str(now[key]), f"{flag} {then[key]}"))
    if then.get("global_batch_size") is not None and then["global_batch_size"] != now["global_batch_size"]:
        found.append((f"--global-batch-size {then['global_batch_size']}",
                      f"{now['global_batch_size']}; {_GLOBAL_BATCH_HINT}",
                      f"--global-batch-size {then['global_batch_size']}"))
    if then.get("split") is not None and _train_share(then["split"]) != _train_share(now["split"]):
        found.append((f"--split {then['split']}", now["split"], f"--split {then['split']}"))
    if not _same_data(then, now):
        counts = lambda r: "; ".join(f"{d} documents, {t} tokens" for d, t in r["corpus"])  # noqa: E731
        same_flags = _data_flags(then) == _data_flags(now)
        found.append((f"{_data_flags(then)} [{counts(then)}]", f"{_data_flags(now)} [{counts(now)}]",
                      _data_fix(then, now) + (" with the corpus files it was saved with" if same_flags else "")))
    if then.get("tokenizer") is not None and then["tokenizer"] != now["tokenizer"]:
        (kind, vocab), (now_kind, now_vocab) = then["tokenizer"], now["tokenizer"]
        found.append((f"--tokenizer-type {kind} (vocabulary {vocab})", f"{now_kind} (vocabulary {now_vocab})",
                      f"--tokenizer-type {kind} and its files"))
    return found


def _other_samples(where: str, then: dict, now: dict) -> List[str]:
    """The same settings, other samples before the checkpoint: refused when the corpus
    files changed; one warning line when this run's --train-iters reorders the set (a
    run may need to end elsewhere than it was started for)."""
    saved, here = then.get("samples"), now.get("samples")
    if not saved or not here or saved == here:
        return []
    gbs = then["global_batch_size"]
    iteration = (saved["first"] + saved["count"]) // gbs
    if then.get("train_samples") not in (None, now["train_samples"]):
        iters = then["train_samples"] // gbs
        return [f"warning: {where} --train-iters {iters} (this run: {now['train_samples'] // gbs}), and this run's "
                "training set holds another number of epochs of the corpus: megatron shuffles all the epochs of "
                f"a set together, so the samples before iteration {iteration} are others than those it trained on "
                "and this run goes on in the new order (some samples again, some never); resume with "
                f"--train-iters {iters} to keep its order"]
    raise CheckpointError(
        f"{where} this run's data flags, but the samples before iteration {iteration} differ from those it "
        "trained on: the corpus files changed since it was saved; resume with the files it was saved with")


def _legacy(saved_layout: dict) -> dict:
    """A checkpoint saved before the record existed: its seed and global batch size."""
    return {key: saved_layout.get(key) for key in ("seed", "global_batch_size")}


def compare_data(directory: str, saved_layout: dict, now: Optional[dict]) -> List[str]:
    """Refuse (``CheckpointError``, one line) a resume of the checkpoint in ``directory``
    that would train on other samples than the run it continues; return the warnings
    to print (a checkpoint without a record). ``now``: this run's record (None: nothing
    is compared)."""
    if now is None:
        return []
    where = f"checkpoint {directory} was saved with"
    then = saved_layout.get("data")
    warnings = []
    if then is None:
        then = _legacy(saved_layout)
        warnings.append(f"warning: checkpoint {directory} records no data settings (saved by an older "
                        "version): --seq-length, --data-path, --split, the corpus and the tokenizer are not "
                        "checked; resume with the ones it was saved with")
    differences = _differences(then, now)
    if differences:
        raise CheckpointError(
            f"{where} {', '.join(f'{a} (this run: {b})' for a, b, _ in differences)}: this run would train "
            f"on other samples than the run it continues; resume with {' '.join(fix for _, _, fix in differences)}")
    return warnings + _other_samples(where, then, now)
