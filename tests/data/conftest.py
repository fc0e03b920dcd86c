"""Shared fixtures of the data-pipeline tests: a small default corpus, a tiny
GPT-2-style BPE made from files, the sample documents as input files."""
import json
import os

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatron_sdp4bit.data.corpus import prepare_default_corpus

from data_samples import SAMPLE_DOCUMENTS


@pytest.fixture(scope="session")
def small_corpus_prefix(tmp_path_factory):
    """The default corpus capped at 1 MiB (tokenizer trained on that text), built once."""
    return prepare_default_corpus(cache_dir=str(tmp_path_factory.mktemp("sdp4bit_cache")), max_mb=1)


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """vocab.json + merges.txt of a tiny byte-level BPE trained here (no download)."""
    directory = tmp_path_factory.mktemp("gpt2_bpe")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(SAMPLE_DOCUMENTS * 3, trainer)
    vocab, merges = backend.model.save(str(directory))
    assert os.path.basename(vocab) == "vocab.json" and os.path.basename(merges) == "merges.txt"
    with open(vocab, encoding="utf-8") as f:
        assert "<|endoftext|>" in json.load(f)
    return vocab, merges


@pytest.fixture
def sample_inputs(tmp_path):
    """The sample documents as one JSONL file and as one text file per document."""
    jsonl = tmp_path / "docs.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for i, doc in enumerate(SAMPLE_DOCUMENTS):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
            if i == 3:
                f.write("\n")  # blank lines are skipped
    text_files = []
    for i, doc in enumerate(SAMPLE_DOCUMENTS):
        path = tmp_path / f"doc{i:03d}.txt"
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(doc)
        text_files.append(str(path))
    return str(jsonl), text_files
