"""``--split`` text is checked in one place (``data/splits.py``), and the document
bounds we compute are megatron-core's, so the checks and suggestions built on them
hold for the datasets megatron builds.

Before: megatron-core's pattern dropped what was not a digit or a dot, so
``2,-1,0`` trained as 2,1,0, ``a,b`` failed with ``cannot convert float NaN to
integer`` and four weights with a bare ``AssertionError``.
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix, parse_and_normalize_split)

from megatron_sdp4bit.data.splits import split_bounds, split_weights, split_with_validation


@pytest.mark.parametrize("text, weights", [
    ("969,30,1", (969, 30, 1)), ("98,2", (98, 2, 0)), ("1", (1, 0, 0)), ("99/1/0", (99, 1, 0)),
    (" 90, 10 ,0", (90, 10, 0)), ("0.9,0.1,0", (0.9, 0.1, 0)),
])
def test_weights_are_read_as_megatron_reads_them(text, weights):
    assert split_weights(text) == weights
    assert list(split_weights(text)) == pytest.approx(
        [w * sum(weights) for w in parse_and_normalize_split(text)])


@pytest.mark.parametrize("text, words", [
    ("a,b", "'a' is not a weight"), ("2,-1,0", "'-1' is not a weight"), ("0,0,0", "every set weight 0"),
    ("1,1,1,1", "4 weights"), ("1,,1", "'' is not a weight"), ("nan,1,0", "'nan' is not a weight"),
])
def test_bad_split_text_is_refused_naming_it(text, words):
    with pytest.raises(ValueError, match=words):
        split_weights(text)


@given(st.lists(st.integers(0, 1000), min_size=3, max_size=3).filter(lambda w: sum(w) > 0),
       st.integers(1, 5000))
def test_bounds_are_megatrons(weights, documents):
    text = ",".join(map(str, weights))
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(text))
    expected = [None if b is None else (int(round(b[0] * float(documents))), int(round(b[1] * float(documents))))
                for b in matrix]
    assert split_bounds(split_weights(text), documents) == expected


@pytest.mark.parametrize("documents", [2, 3, 5, 7, 49, 1000])
def test_the_suggested_split_gives_training_and_validation_a_document(documents):
    train, valid, test = split_bounds(split_weights(split_with_validation(documents)), documents)
    assert train[1] > train[0] and valid[1] > valid[0] and test is None
    assert split_with_validation(1) is None
