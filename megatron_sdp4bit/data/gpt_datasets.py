"""Train/valid/test GPT datasets from Megatron indexed data, via megatron-core.

This is the one module of ``megatron_sdp4bit.data`` that imports megatron at
import time. ``build_gpt_datasets`` is a thin front to megatron-core's
``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` + ``GPTDataset``, so
data preprocessed for Megatron-LM is read exactly as Megatron-LM reads it
(memory-mapped ``.bin``, same splits, same shuffles, same cached indices). What
it adds is checking first, because megatron-core fails late and obscurely:

- missing ``.bin``/``.idx`` files -> ``FileNotFoundError`` naming every one;
- a damaged ``.idx`` -> ``ValueError`` naming it (``indexed_files``);
- a split that gets no document -> ``ValueError`` with a split that gives it one
  (megatron would loop forever looking for tokens, or read out of bounds); a
  split asked for 0 samples is not built (``None``) and not checked, its weight
  still placing the others' bounds; ``--split`` text itself: ``splits.py``;
- data too small for the samples asked -> ``ValueError`` (``coverage.py``);
- no compiled ``helpers_cpp`` -> the exact NumPy twins (``numpy_dataset_helpers``).

Several ranks: call it on every rank. megatron-core builds the index caches on
global rank 0 while the others wait in ``torch.distributed.barrier()`` (gloo
works), then the others load them; ``path_to_cache`` must therefore be on a
filesystem all ranks share. Without a process group we open a private
one-process gloo group for the duration of the build: megatron-core 0.16.1's
``BlendedDataset`` calls ``torch.distributed.get_rank()`` unguarded when it
writes its cache, which fails outside a process group.
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import logging
import os
import sys
import types
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_sdp4bit.data import numpy_dataset_helpers
from megatron_sdp4bit.data.cache import default_cache_dir
from megatron_sdp4bit.data.coverage import check_coverage
from megatron_sdp4bit.data.indexed_files import check_indexed_prefix, missing_files
from megatron_sdp4bit.data.splits import SET_NAMES, split_bounds, split_weights, split_with_validation
from megatron_sdp4bit.patching import Patches

logger = logging.getLogger(__name__)

HELPERS_ENV = "SDP4BIT_DATASET_HELPERS"
"""Set to ``numpy`` to use the NumPy helpers even where the compiled ones exist."""


def _helpers_of_this_release() -> Tuple[str, Tuple[str, ...], str]:
    """(module name of megatron's compiled helpers, the functions we have twins of, the
    module that imports them), from the patch layer's adapter for the installed
    megatron-core."""
    from megatron_sdp4bit.megatron.adapters import current_adapter

    adapter = current_adapter()
    return adapter.dataset_helpers_module, adapter.dataset_helper_names, adapter.dataset_helpers_importer


_CPP_MODULE, _HELPER_NAMES, _HELPERS_IMPORTER = _helpers_of_this_release()

Blend = Tuple[List[str], Optional[List[float]]]


def _compiled_helpers_import() -> bool:
    try:
        importlib.import_module(_CPP_MODULE)
        return True
    except ImportError as error:
        logger.warning("megatron-core's compiled dataset helpers are missing (%s); "
                       "using the equivalent NumPy helpers.", error)
        return False


@contextlib.contextmanager
def dataset_helpers_in_place(force_numpy: Optional[bool] = None) -> Iterator[str]:
    """Inside: megatron's ``datasets.helpers`` importable; yields ``"cpp"`` or ``"numpy"``.

    Uses the compiled extension when it imports, else (or when ``force_numpy``,
    default from ``$SDP4BIT_DATASET_HELPERS == "numpy"``) puts the NumPy twins under
    its module name, and into ``helpers`` if megatron imported that already. On exit
    all of it is taken back (``megatron_sdp4bit.patching``): megatron uses the helpers
    while it builds the indices only, and the process is left as it was found.
    """
    if force_numpy is None:
        force_numpy = os.environ.get(HELPERS_ENV, "").lower() == "numpy"
    if not force_numpy and _compiled_helpers_import():
        yield "cpp"
        return
    twins = types.ModuleType(_CPP_MODULE, "NumPy twins of helpers_cpp (megatron_sdp4bit)")
    for name in _HELPER_NAMES:
        setattr(twins, name, getattr(numpy_dataset_helpers, name))
    with Patches("dataset helpers") as patches:
        patches.set_item(sys.modules, _CPP_MODULE, twins)
        helpers = sys.modules.get(_HELPERS_IMPORTER)
        if helpers is not None:  # imported earlier: rebind the names it copied
            for name in _HELPER_NAMES:
                patches.set(helpers, name, getattr(numpy_dataset_helpers, name))
        else:  # imported from the twins inside; forgotten after, so a later import starts afresh
            package, _, leaf = _HELPERS_IMPORTER.rpartition(".")
            patches.keep_item(sys.modules, _HELPERS_IMPORTER)
            patches.keep(importlib.import_module(package), leaf)
        yield "numpy"


def index_cache_dir(path_to_cache: Optional[str] = None) -> str:
    """Where megatron-core keeps the sample-index ``.npy`` files (and we the token-id
    scans): ``path_to_cache`` (``--data-cache-path``), else ``<cache dir>/dataset_indices``."""
    return path_to_cache or os.path.join(default_cache_dir(), "dataset_indices")


def parse_data_path(data_path: Union[str, Sequence[str]]) -> Blend:
    """Megatron's ``--data-path``: ``[P1, P2, ...]`` or ``[W1, P1, W2, P2, ...]``.

    A single string is split on whitespace. Returns (prefixes, weights or None).
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty: give at least one dataset prefix.")

    def is_number(text: str) -> bool:
        try:
            float(text)
            return True
        except ValueError:
            return False

    numeric = [is_number(x) for x in items]
    if len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights = [float(w) for w in items[0::2]]
        if any(w <= 0 for w in weights):
            raise ValueError(f"--data-path weights must be positive, got {weights}.")
        prefixes, blend_weights = items[1::2], weights
    elif not any(numeric):
        prefixes, blend_weights = items, None
    else:
        raise ValueError(
            f"cannot read --data-path {items}: give prefixes only, or weight/prefix pairs "
            "(e.g. 0.3 data/a_text_document 0.7 data/b_text_document)."
        )
    for prefix in prefixes:
        if prefix.endswith((".bin", ".idx")):
            raise ValueError(f"--data-path takes prefixes, not files: use {prefix[:-4]!r} for {prefix!r}.")
    return list(prefixes), blend_weights


def _pairs(pattern: str) -> List[str]:
    """Prefixes of the ``.bin``/``.idx`` pairs that ``pattern`` + ``.bin`` matches."""
    return [found[:-4] for found in sorted(glob.glob(pattern + ".bin")) if os.path.isfile(found[:-4] + ".idx")]


def _missing_prefix_hint(prefix: str) -> Optional[str]:
    """What a ``prefix`` without files probably meant: a folder's datasets, or the
    ``PREFIX_KEY_document`` pair the preprocessor wrote for ``--output-prefix PREFIX``."""
    if os.path.isdir(prefix):
        found = _pairs(os.path.join(glob.escape(prefix), "*"))
        return f"{prefix} is a folder" + (f" holding {', '.join(found)}" if found else " without datasets")
    if os.path.isfile(prefix + ".bin") or os.path.isfile(prefix + ".idx"):
        return None
    found = _pairs(glob.escape(prefix) + "_*_document")
    return (f"the preprocessor adds _KEY_document to its --output-prefix: {prefix} -> {', '.join(found)}"
            if found else None)


def check_data_path(data_path: Union[str, Sequence[str]]) -> Blend:
    """Parse ``--data-path`` and check every ``.bin``/``.idx`` before any work starts.

    Raises FileNotFoundError naming every missing file, ValueError naming a
    damaged one. Returns (prefixes, weights or None).
    """
    prefixes, weights = parse_data_path(data_path)
    missing = missing_files(prefixes)
    if missing:
        hints = list(filter(None, map(_missing_prefix_hint, prefixes)))
        raise FileNotFoundError("missing indexed dataset file(s): " + ", ".join(missing)
                                + " (--data-path takes the prefix of PREFIX.bin/PREFIX.idx"
                                + "".join(f"; {hint}" for hint in hints) + ").")
    for prefix in prefixes:
        check_indexed_prefix(prefix)
    return prefixes, weights


def _no_document_fix(set_name: str, num_sequences: int) -> str:
    """What to do when a split gives ``set_name`` no document of a dataset."""
    if set_name == "validation":
        suggestion = split_with_validation(num_sequences)
        weight = f"give it more weight (--split {suggestion} gives it a document), " if suggestion else ""
        return f"{weight}evaluate nothing (--eval-iters 0), or use more data"
    if set_name == "test":
        return "give it weight 0 (e.g. --split 99,1,0: the driver never reads it) or use more data"
    return "give it more weight or use more data"


def _check_splits(prefix: str, num_sequences: int, split: str, sizes: Sequence[Optional[int]]) -> None:
    """Fail where megatron-core would hang or read out of bounds: a split with
    nonzero weight, asked for samples (``sizes``: 0 = not used), that receives no
    sequence of ``prefix``."""
    for name, bounds, size in zip(SET_NAMES, split_bounds(split_weights(split), num_sequences), sizes):
        if bounds is None or size == 0:
            continue
        if bounds[1] <= bounds[0]:
            raise ValueError(f"--split {split} gives the {name} set no document of {prefix} "
                             f"({num_sequences} document{'s' * (num_sequences != 1)}): "
                             f"{_no_document_fix(name, num_sequences)}")


def check_gpt_data(data_path: Union[str, Sequence[str]], split: str,
                   sizes: Sequence[Optional[int]] = (None, None, None), seq_length: Optional[int] = None,
                   needed: Optional[Sequence[Optional[int]]] = None) -> Blend:
    """Every check ``build_gpt_datasets`` makes before megatron-core builds anything:
    the files (``check_data_path``), sample counts for a weighted blend, that every
    split it is asked to build (a weight above 0 and a sample count other than 0 in
    ``sizes``) gets a document and, given ``seq_length``, that the data covers the
    samples asked (``coverage.check_coverage``; ``needed``: see there).
    Touches no process group, so it can be run and agreed on every rank."""
    prefixes, weights = check_data_path(data_path)
    if weights is not None and None in sizes:
        raise ValueError("a weighted --data-path needs explicit train/valid/test sample counts.")
    for prefix in prefixes:
        _check_splits(prefix, check_indexed_prefix(prefix).num_sequences, split, sizes)
    if seq_length is not None:
        check_coverage(prefixes, weights, split, seq_length, sizes, needed)
    return prefixes, weights


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """The caller's process group, or a private one-process gloo group while inside."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_gpt_datasets(
    data_path: Union[str, Sequence[str]],
    tokenizer,
    seq_length: int,
    train_samples: Optional[int],
    valid_samples: Optional[int] = None,
    test_samples: Optional[int] = None,
    split: str = "969,30,1",
    seed: int = 1234,
    path_to_cache: Optional[str] = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> List[Optional[torch.utils.data.Dataset]]:
    """Build ``[train, valid, test]`` megatron datasets (``None`` for a split of weight 0).

    Args:
        data_path: Megatron ``--data-path`` (prefixes, optionally weight/prefix pairs).
        tokenizer: anything with ``vocab_size``, ``eod`` and ``unique_identifiers``
            (``megatron_sdp4bit.data.tokenizer.Tokenizer``, or a megatron tokenizer).
        seq_length: tokens per sample; each sample reads ``seq_length + 1`` tokens
            and returns ``tokens``/``labels`` shifted by one.
        train_samples, valid_samples, test_samples: samples to draw per split
            (more than one epoch repeats the data, reshuffled); ``None`` = one epoch
            (only without weights); 0 = the split is not used (not built: ``None``).
        split: Megatron ``--split``, e.g. ``"969,30,1"``.
        seed: the shuffle seed.
        path_to_cache: where the sample-index ``.npy`` files go (Megatron
            ``--data-cache-path``); default ``<cache dir>/dataset_indices``.
        reset_position_ids, reset_attention_mask, eod_mask_loss: as in Megatron-LM.
        create_attention_mask: also return a [1, s, s] mask (megatron-core's local
            attention builds the causal mask itself, so it is off by default).
        is_built_on_rank: Megatron's hook; all ranks by default.

    Each sample is a dict of tensors: ``tokens``, ``labels`` (int64, [seq_length]),
    ``loss_mask`` (float), ``position_ids`` (int64) and, for blends, ``dataset_id``.
    """
    if not isinstance(seq_length, int) or seq_length < 2:
        raise ValueError(f"seq_length must be an integer >= 2, got {seq_length!r}.")
    for name, count in (("train", train_samples), ("valid", valid_samples), ("test", test_samples)):
        if count is not None and (not isinstance(count, int) or count < 0):
            raise ValueError(f"{name}_samples must be a non-negative integer or None, got {count!r}.")
    for attribute in ("vocab_size", "eod"):
        if getattr(tokenizer, attribute, None) is None:
            raise ValueError(f"tokenizer {tokenizer!r} has no {attribute}; megatron's GPTDataset needs it.")
    sizes = [train_samples, valid_samples, test_samples]
    prefixes, weights = check_gpt_data(data_path, split, sizes, seq_length)

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=index_cache_dir(path_to_cache),
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=True,
    )
    # A split of 0 samples is not built (None), and the others keep their documents:
    # the split's bounds stay those of its weights.
    config.split_matrix = [None if size == 0 else bounds for bounds, size in zip(config.split_matrix, sizes)]
    with _process_group():
        with dataset_helpers_in_place():
            return BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built_on_rank, config).build()
