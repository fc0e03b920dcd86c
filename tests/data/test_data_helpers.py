"""The NumPy dataset helpers are bit-identical to megatron-core's compiled ones."""
import sys

import numpy
import pytest
import torch

from megatron_sdp4bit.data import numpy_dataset_helpers as numpy_helpers
from megatron_sdp4bit.data import load_default_corpus_tokenizer
from megatron_sdp4bit.data.gpt_datasets import (_CPP_MODULE, _HELPER_NAMES, HELPERS_ENV, build_gpt_datasets,
                                                dataset_helpers_in_place)

cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp")


def _documents(rng, n_docs, zero_fraction=0.0):
    sizes = rng.integers(1, 300, size=n_docs).astype(numpy.int32)
    sizes[rng.random(n_docs) < zero_fraction] = 0
    return sizes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("extra", [1, 0])
def test_build_sample_idx(seed, drop_last, extra):
    rng = numpy.random.default_rng(seed)
    n_docs = int(rng.integers(1, 60))
    sizes = _documents(rng, n_docs, zero_fraction=0.1 * (seed % 2))
    sizes[0] = max(sizes[0], 2)
    epochs = int(rng.integers(1, 4))
    document_idx = numpy.concatenate([rng.permutation(n_docs) for _ in range(epochs)]).astype(numpy.int32)
    tokens_per_epoch = int(sizes.sum())
    seq = int(rng.choice([2, 3, 7, 16, 64, 1000]))
    for name in ("build_sample_idx_int32", "build_sample_idx_int64"):
        expected = getattr(cpp, name)(sizes, document_idx, seq, epochs, tokens_per_epoch, drop_last, extra)
        got = getattr(numpy_helpers, name)(sizes, document_idx, seq, epochs, tokens_per_epoch, drop_last, extra)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        numpy.testing.assert_array_equal(got, expected)


def test_build_sample_idx_single_precision_sample_count():
    # 2**24 + 1 tokens is not a float32: the compiled ceil(float(n) / seq) sees
    # 2**24 / 2**20 = 16 samples where exact arithmetic gives 17.
    sizes = numpy.array([2**24 + 2], dtype=numpy.int32)
    document_idx = numpy.zeros(1, dtype=numpy.int32)
    args = (sizes, document_idx, 2**20, 1, 2**24 + 2, False, 1)
    expected = cpp.build_sample_idx_int64(*args)
    assert expected.shape == (16 + 1, 2)
    numpy.testing.assert_array_equal(numpy_helpers.build_sample_idx_int64(*args), expected)


@pytest.mark.parametrize("seed", range(5))
def test_build_blending_indices(seed):
    rng = numpy.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    weights = rng.random(n) + 0.01
    weights = (weights / weights.sum()).tolist()
    size = int(rng.integers(1, 3000))
    results = []
    for helpers in (cpp, numpy_helpers):
        index, sample = numpy.zeros(size, numpy.int16), numpy.zeros(size, numpy.int64)
        helpers.build_blending_indices(index, sample, weights, n, size, False)
        results.append((index, sample))
    numpy.testing.assert_array_equal(results[0][0], results[1][0])
    numpy.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("seed", range(5))
def test_build_exhaustive_blending_indices(seed):
    rng = numpy.random.default_rng(100 + seed)
    n = int(rng.integers(1, 7))
    sizes = rng.integers(1, 500, size=n).tolist()
    results = []
    for helpers in (cpp, numpy_helpers):
        index, sample = numpy.zeros(sum(sizes), numpy.int16), numpy.zeros(sum(sizes), numpy.int64)
        helpers.build_exhaustive_blending_indices(index, sample, sizes, n)
        results.append((index, sample))
    numpy.testing.assert_array_equal(results[0][0], results[1][0])
    numpy.testing.assert_array_equal(results[0][1], results[1][1])


def test_missing_extension_falls_back_inside_and_everything_is_back_after(monkeypatch):
    import megatron.core.datasets.helpers as helpers

    monkeypatch.delenv(HELPERS_ENV, raising=False)
    with dataset_helpers_in_place() as kind:
        assert kind == "cpp" and helpers.build_sample_idx_int32 is cpp.build_sample_idx_int32
    monkeypatch.setitem(sys.modules, _CPP_MODULE, None)  # makes `import helpers_cpp` raise ImportError
    with dataset_helpers_in_place() as kind:
        assert kind == "numpy"
        for name in _HELPER_NAMES:
            assert getattr(helpers, name) is getattr(numpy_helpers, name)
            assert getattr(sys.modules[_CPP_MODULE], name) is getattr(numpy_helpers, name)
    assert sys.modules[_CPP_MODULE] is None
    for name in _HELPER_NAMES:
        assert getattr(helpers, name) is getattr(cpp, name)


def test_helpers_first_imported_from_the_twins_are_forgotten_after(monkeypatch):
    """Without the extension, megatron's ``helpers`` can only be imported from the twins:
    inside, it is; after, neither it nor the twins are left in ``sys.modules``."""
    import megatron.core.datasets as datasets

    importer = "megatron.core.datasets.helpers"
    monkeypatch.delitem(sys.modules, importer)
    monkeypatch.delattr(datasets, "helpers")
    monkeypatch.setitem(sys.modules, _CPP_MODULE, None)  # the extension does not import
    with dataset_helpers_in_place() as kind:
        from megatron.core.datasets import helpers

        assert kind == "numpy" and helpers.build_sample_idx_int32 is numpy_helpers.build_sample_idx_int32
    assert importer not in sys.modules and not hasattr(datasets, "helpers")
    assert sys.modules[_CPP_MODULE] is None


def test_gpt_datasets_identical_with_numpy_helpers(small_corpus_prefix, tmp_path, monkeypatch):
    tokenizer = load_default_corpus_tokenizer(small_corpus_prefix)
    blend = ["1", small_corpus_prefix, "2", small_corpus_prefix]

    def build(cache):
        return build_gpt_datasets(blend, tokenizer, 32, 900, 30, 0, split="95,5,0",
                                  path_to_cache=str(tmp_path / cache), seed=3)

    compiled = build("cpp")
    monkeypatch.setenv(HELPERS_ENV, "numpy")
    ported = build("numpy")
    for a, b in zip(compiled, ported):
        if a is None:
            assert b is None
            continue
        numpy.testing.assert_array_equal(a.dataset_index, b.dataset_index)
        numpy.testing.assert_array_equal(a.dataset_sample_index, b.dataset_sample_index)
        for da, db in zip(a.datasets, b.datasets):
            numpy.testing.assert_array_equal(da.sample_index, db.sample_index)
        for i in range(0, len(a), 37):
            assert torch.equal(a[i]["tokens"], b[i]["tokens"])
