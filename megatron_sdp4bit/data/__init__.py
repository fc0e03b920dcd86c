"""The data pipeline: Megatron indexed datasets (.bin/.idx) in, GPT micro-batches out.

- ``tokenizer``: GPT-2 BPE / HuggingFace / default tokenizers megatron accepts;
  ``tokenizer_types``: which one a command line asks for (``build_tokenizer``).
- ``documents``, ``preprocess``: text/JSONL -> .bin/.idx (``sdp4bit-preprocess``).
- ``corpus``: the download-free default corpus (the Python stdlib), cached.
- ``indexed_files``: write .bin/.idx with megatron's builder; check them.
- ``gpt_datasets``: megatron-core GPTDataset / blends (the only module that
  imports megatron at import time); ``numpy_dataset_helpers``: NumPy twins of its C++.
- ``splits``, ``coverage``, ``token_ids``: the checks made before megatron reads
  the data (``--split``, data too small for a run, ids against the vocabulary);
  ``cache``: the cache folder.
- ``batches``: one data-parallel rank's micro-batches.

Every name below is loaded on first use, so ``import megatron_sdp4bit.data``
imports neither torch nor megatron.
"""
import importlib

# name -> module that defines it; imported on first use so that importing one
# submodule (e.g. the preprocess CLI in a worker process) pulls in nothing heavy.
_EXPORTS = {
    "DataParallelBatchSampler": "batches",
    "iterate_micro_batches": "batches",
    "batch_to_device": "batches",
    "prepare_default_corpus": "corpus",
    "load_default_corpus_tokenizer": "corpus",
    "check_indexed_prefix": "indexed_files",
    "preprocess": "preprocess",
    "Tokenizer": "tokenizer",
    "TokenizerSpec": "tokenizer_types",
    "build_tokenizer": "tokenizer_types",
    "build_gpt_datasets": "gpt_datasets",
    "parse_data_path": "gpt_datasets",
    "dataset_helpers_in_place": "gpt_datasets",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
