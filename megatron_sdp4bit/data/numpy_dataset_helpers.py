"""NumPy/Python twins of megatron-core's compiled dataset helpers (``helpers_cpp``).

megatron-core builds GPT sample indices and blend indices with a pybind11
extension, ``megatron/core/datasets/helpers_cpp*.so``. The 0.16.1 wheel ships it
compiled, but a source install on a machine without a C++ compiler (or an
interpreter the wheel was not built for) has none, and then every GPTDataset
fails to import ``helpers``. These functions have the same signatures and give
bit-identical results (``tests/data`` compares them with the compiled ones on
random inputs), so ``gpt_datasets.dataset_helpers_in_place`` can register them
under that module name when the extension is missing. Only the four functions
GPT pre-training uses are provided (not the BERT/T5 ``build_mapping`` ones).

This module imports neither megatron nor torch.
"""
from __future__ import annotations

import math

import numpy


def _truncating_div(a: int, b: int) -> int:
    """C++ integer division (rounds toward zero, unlike Python's //)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _num_samples(num_epochs: int, tokens_per_epoch: int, seq_length: int,
                 drop_last_partial_sequence: bool, extra: int) -> int:
    tokens = num_epochs * tokens_per_epoch - extra
    if drop_last_partial_sequence:
        return _truncating_div(tokens, seq_length)
    # helpers.cpp: ceil(float(tokens) / seq_length), in single precision.
    return math.ceil(numpy.float32(tokens) / numpy.float32(seq_length))


def _build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                      drop_last_partial_sequence=True, add_extra_token_to_sequence=1,
                      dtype=numpy.int64) -> numpy.ndarray:
    """Row i = (position in ``document_idx``, token offset) where sample i starts.

    Samples tile the concatenation of the documents in ``document_idx`` order:
    sample i covers global tokens [i*seq_length, (i+1)*seq_length + extra). The
    compiled loop records the start of sample i+1 in the document that holds
    the *last* token of sample i (global position (i+1)*seq_length + extra - 1),
    with the offset measured from that document's start; a sample running past
    the final document is pinned to (last, len(last) - extra). The closed form
    below gives the same rows without the per-token loop.
    """
    extra = int(add_extra_token_to_sequence)
    num_samples = _num_samples(int(num_epochs), int(tokens_per_epoch), int(seq_length),
                               bool(drop_last_partial_sequence), extra)
    lengths = numpy.asarray(sizes)[numpy.asarray(document_idx)].astype(numpy.int64)
    ends = numpy.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1]) if ends.size else 0
    out = numpy.zeros((num_samples + 1, 2), dtype=dtype)
    if num_samples <= 0:
        return out
    sample_starts = numpy.arange(1, num_samples + 1, dtype=numpy.int64) * int(seq_length)
    last_token = sample_starts + extra - 1
    doc = numpy.searchsorted(ends, last_token, side="right")
    past_end = last_token >= total
    inside = ~past_end
    out[1:, 0][inside] = doc[inside]
    out[1:, 1][inside] = sample_starts[inside] - starts[doc[inside]]
    out[1:, 0][past_end] = lengths.size - 1
    out[1:, 1][past_end] = lengths[-1] - extra
    return out


def build_sample_idx_int32(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                           drop_last_partial_sequence=True, add_extra_token_to_sequence=1):
    """``helpers_cpp.build_sample_idx_int32``."""
    return _build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                             drop_last_partial_sequence, add_extra_token_to_sequence, numpy.int32)


def build_sample_idx_int64(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                           drop_last_partial_sequence=True, add_extra_token_to_sequence=1):
    """``helpers_cpp.build_sample_idx_int64``."""
    return _build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                             drop_last_partial_sequence, add_extra_token_to_sequence, numpy.int64)


def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose=False):
    """``helpers_cpp.build_blending_indices``: fill the two arrays in place.

    Greedy: sample i goes to the dataset furthest below its share,
    argmax_d(weights[d] * max(i, 1) - taken[d]), first index on ties. The
    arithmetic is the same double-precision expression as the C++ loop, so the
    choices are identical.
    """
    weights = [float(w) for w in numpy.asarray(weights, dtype=numpy.float64)[:num_datasets]]
    taken = [0] * num_datasets
    chosen = numpy.empty(size, dtype=numpy.int64)
    within = numpy.empty(size, dtype=numpy.int64)
    for i in range(size):
        scale = max(float(i), 1.0)
        best, best_error = 0, weights[0] * scale - taken[0]
        for d in range(1, num_datasets):
            error = weights[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        chosen[i], within[i] = best, taken[best]
        taken[best] += 1
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = within
    if verbose:
        for d in range(num_datasets):
            print(f"   dataset {d}, input: {weights[d]}, achieved: {taken[d] / max(size, 1)}")


def build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets):
    """``helpers_cpp.build_exhaustive_blending_indices``: exactly ``sizes[d]`` samples
    of dataset d, interleaved by the same greedy rule among datasets not yet used up."""
    sizes = [int(s) for s in numpy.asarray(sizes, dtype=numpy.int64)[:num_datasets]]
    total = sum(sizes)
    weights = [s / float(total) for s in sizes]
    taken = [0] * num_datasets
    unspent = [d for d in range(num_datasets)]  # ascending, like the C++ std::set
    chosen = numpy.empty(total, dtype=numpy.int64)
    within = numpy.empty(total, dtype=numpy.int64)
    i = 0
    while unspent:
        scale = max(float(i), 1.0)
        best, best_error = -1, -math.inf
        for d in unspent:
            error = weights[d] * scale - float(taken[d])
            if error > best_error:
                best, best_error = d, error
        chosen[i], within[i] = best, taken[best]
        taken[best] += 1
        if sizes[best] - taken[best] == 0:
            unspent.remove(best)
        i += 1
    dataset_index[:i] = chosen[:i]
    dataset_sample_index[:i] = within[:i]
