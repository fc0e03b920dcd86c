"""megatron-core's GPTDataset over our .bin/.idx: sample shapes, masks, and that
the samples tile the token stream of the split's documents exactly."""
import numpy
import pytest
import torch

from megatron_sdp4bit.data import iterate_micro_batches, load_default_corpus_tokenizer
from megatron_sdp4bit.data.gpt_datasets import build_gpt_datasets, parse_data_path
from megatron_sdp4bit.data.indexed_files import check_indexed_prefix

from data_samples import read_indexed

SEQ = 64


@pytest.fixture(scope="module")
def corpus(small_corpus_prefix):
    return small_corpus_prefix, load_default_corpus_tokenizer(small_corpus_prefix)


def _split_documents(n_docs, split):
    """Megatron's document ranges per split, computed independently."""
    weights = numpy.array([float(x) for x in split.split(",")])
    bounds = numpy.concatenate([[0.0], numpy.cumsum(weights / weights.sum())])
    return [range(int(round(a * n_docs)), int(round(b * n_docs))) for a, b in zip(bounds[:-1], bounds[1:])]


def test_samples_tile_the_document_stream(corpus, tmp_path):
    prefix, tokenizer = corpus
    documents, _ = read_indexed(prefix)
    split = "90,8,2"
    datasets = build_gpt_datasets([prefix], tokenizer, SEQ, None, None, None, split=split,
                                  seed=7, path_to_cache=str(tmp_path / "cache"))
    for dataset, doc_range in zip(datasets, _split_documents(len(documents), split)):
        # One epoch: the documents of the split, each once, in megatron's shuffled order.
        order = numpy.asarray(dataset.document_index)
        assert sorted(order.tolist()) == list(doc_range)
        stream = numpy.concatenate([documents[d] for d in order])
        assert len(dataset) == (len(stream) - 1) // SEQ
        shuffle = numpy.asarray(dataset.shuffle_index)
        assert sorted(shuffle.tolist()) == list(range(len(dataset)))
        for i in range(len(dataset)):
            sample = dataset[i]
            k = int(shuffle[i])
            window = torch.from_numpy(stream[k * SEQ: (k + 1) * SEQ + 1])
            assert torch.equal(sample["tokens"], window[:-1])
            assert torch.equal(sample["labels"], window[1:])
            assert torch.equal(sample["loss_mask"], torch.ones(SEQ))
            assert torch.equal(sample["position_ids"], torch.arange(SEQ))
            assert "attention_mask" not in sample


def test_more_samples_than_an_epoch_and_eod_masks(corpus, tmp_path):
    prefix, tokenizer = corpus
    (train, valid, test) = build_gpt_datasets(prefix, tokenizer, SEQ, 3000, 10, 0, split="98,2,0",
                                              path_to_cache=str(tmp_path / "c"), eod_mask_loss=True,
                                              reset_position_ids=True)
    assert test is None and len(train) >= 3000 and len(valid) >= 10
    seen_eod = 0
    for i in range(0, 3000, 3):
        sample = train[i]
        eod = sample["tokens"] == tokenizer.eod
        seen_eod += int(eod.any())
        assert torch.equal(sample["loss_mask"], (~eod).float())
        # positions count from 0 again after every EOD
        expected, position = [], 0
        for token in sample["tokens"].tolist():
            expected.append(position)
            position = 0 if token == tokenizer.eod else position + 1
        assert sample["position_ids"].tolist() == expected
    assert seen_eod


def test_weighted_blend_and_micro_batches(corpus, tmp_path):
    prefix, tokenizer = corpus
    train, _, _ = build_gpt_datasets(["0.25", prefix, "0.75", prefix], tokenizer, SEQ, 400, 8, 4,
                                     split="90,8,2", path_to_cache=str(tmp_path / "b"))
    ids = torch.tensor([int(train[i]["dataset_id"]) for i in range(len(train))])
    assert len(train) >= 400
    assert abs(float((ids == 1).float().mean()) - 0.75) < 0.01
    # Two DP ranks: disjoint micro-batches that interleave into consecutive samples.
    mbs, dp = 3, 2
    rank_batches = [list(iterate_micro_batches(train, mbs, r, dp, consumed_samples=5)) for r in range(dp)]
    assert len(rank_batches[0]) == len(rank_batches[1]) == (len(train) - 5) // (mbs * dp)
    for step in range(4):
        for r in range(dp):
            batch = rank_batches[r][step]
            assert batch["tokens"].shape == (mbs, SEQ) and batch["tokens"].dtype == torch.int64
            assert batch["loss_mask"].dtype == torch.float32
            for b in range(mbs):
                index = 5 + step * mbs * dp + r * mbs + b
                assert torch.equal(batch["tokens"][b], train[index]["tokens"])


def test_cache_is_reused(corpus, tmp_path):
    prefix, tokenizer = corpus
    cache = tmp_path / "reuse"
    first = build_gpt_datasets(prefix, tokenizer, SEQ, 100, 5, 5, split="90,8,2", path_to_cache=str(cache))
    files = sorted(p.name for p in cache.iterdir())
    assert any(name.endswith("GPTDataset-train-sample_index.npy") for name in files)
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    second = build_gpt_datasets(prefix, tokenizer, SEQ, 100, 5, 5, split="90,8,2", path_to_cache=str(cache))
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    assert torch.equal(first[0][17]["tokens"], second[0][17]["tokens"])


def test_info_matches_files(corpus):
    prefix, _ = corpus
    documents, _ = read_indexed(prefix)
    info = check_indexed_prefix(prefix)
    assert info.num_documents == info.num_sequences == len(documents)
    assert info.num_tokens == sum(map(len, documents))


@pytest.mark.parametrize("data_path, expected", [
    ("a b", (["a", "b"], None)),
    (["30", "a", "70", "b"], (["a", "b"], [30.0, 70.0])),
    (["a"], (["a"], None)),
])
def test_parse_data_path(data_path, expected):
    assert parse_data_path(data_path) == expected
