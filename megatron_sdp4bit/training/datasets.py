"""The driver's data: the tokenizer, the train and validation datasets, and the
micro-batch iterators each rank reads (the embedded corpus when no --data-path).

Before megatron-core builds anything, every rank checks alike (``on_every_rank``),
in the order a user fixes things: the files, the tokenizer, the cache folder the
indices go to, the splits and whether the data covers the run, then the token ids
against the tokenizer's vocabulary.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_sdp4bit.data.batches import iterate_micro_batches
from megatron_sdp4bit.data.cache import check_writable
from megatron_sdp4bit.data.corpus import load_default_corpus_tokenizer, prepare_default_corpus
from megatron_sdp4bit.data.coverage import set_reads
from megatron_sdp4bit.data.gpt_datasets import (build_gpt_datasets, check_data_path, check_gpt_data,
                                                index_cache_dir, parse_data_path)
from megatron_sdp4bit.data.token_ids import check_vocabulary, eod_mismatch
from megatron_sdp4bit.data.tokenizer_types import TOKENIZER_TYPES, build_tokenizer
from megatron_sdp4bit.training.agreement import on_every_rank
from megatron_sdp4bit.training.arguments import ArgumentError
from megatron_sdp4bit.training.console import log0
from megatron_sdp4bit.training.distributed import ParallelLayout

MANY_EPOCHS = 4
"""A run that reads its training set more often than this is warned: past about 4
epochs repeated data is worth less than new data (Muennighoff et al., "Scaling
Data-Constrained Language Models", 2023), and far past it the model memorizes."""


def _tokenizer_and_prefixes(args) -> tuple:
    """(tokenizer, data prefixes): the files checked first (the commonest mistake),
    then the tokenizer built, alike on every rank."""
    if args.data_path:
        on_every_rank(lambda: check_data_path(args.data_path))
        if args.tokenizer_type is None:
            raise ArgumentError("--data-path needs --tokenizer-type: the tokenizer the data was "
                                f"preprocessed with ({', '.join(TOKENIZER_TYPES)})")
        tokenizer = on_every_rank(lambda: build_tokenizer(
            args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model))
        return tokenizer, args.data_path
    files = [flag for flag, value in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                                      ("--tokenizer-model", args.tokenizer_model)) if value is not None]
    if args.tokenizer_type not in (None, "StdlibBPETokenizer") or files:  # (a config file may name one)
        given = f"--tokenizer-type {args.tokenizer_type}" if not files else " and ".join(files)
        raise ArgumentError(f"{given} needs --data-path (without it the run trains on the embedded corpus, "
                            "which has its own tokenizer)")
    prefix = on_every_rank(lambda: prepare_default_corpus(max_mb=args.default_corpus_mb))
    log0(f"data: embedded corpus (Python standard library) at {prefix}")
    return load_default_corpus_tokenizer(prefix), [prefix]


def sample_counts(args) -> list:
    """Samples the run reads from the train, validation and test splits. The test
    split is never read (0: not built, so a small corpus need not give it a
    document), nor the validation split without evaluation (``--eval-iters 0``, or
    a split that gives it weight 0)."""
    evaluations = args.train_iters // args.eval_interval + 1
    return [args.train_iters * args.global_batch_size,
            evaluations * args.eval_iters * args.global_batch_size, 0]


def _warn_about_epochs(args, data_path, sizes: list) -> None:
    """One line when the run reads a training set more than ``MANY_EPOCHS`` times."""
    prefixes, weights = parse_data_path(data_path)
    reads = [r for r in set_reads(prefixes, weights, args.split, args.seq_length, sizes)
             if r.set_name == "training"]
    worst = max(reads, key=lambda r: r.epochs, default=None)
    if worst is None or worst.epochs <= MANY_EPOCHS:
        return
    iters = int(args.train_iters * MANY_EPOCHS / worst.epochs)
    fewer = f"--train-iters {iters} reads it at most {MANY_EPOCHS} times" if iters else "fewer --train-iters"
    log0(f"warning: the run reads the training set of {worst.prefix} {worst.epochs:.1f} times (epochs): "
         f"{worst.samples} samples of --seq-length {args.seq_length} from its {worst.tokens} tokens; "
         f"the model will memorize it rather than learn. Use more data (--data-path), or {fewer}")


def build_data(args) -> tuple:
    """(tokenizer, train dataset, validation dataset): as many samples as the run reads."""
    sizes = sample_counts(args)
    if args.no_evaluation and args.no_evaluation != "--eval-iters 0":
        log0(f"evaluation: off, {args.no_evaluation} (give it weight, e.g. --split 98,2,0, to evaluate; "
             "--eval-iters 0 turns evaluation off without this line)")
    tokenizer, data_path = _tokenizer_and_prefixes(args)
    index_cache = index_cache_dir(args.data_cache_path)
    on_every_rank(lambda: check_writable(index_cache, "the dataset index files", "--data-cache-path")
                  if args.data_cache_path else check_writable(index_cache))
    needed = [sizes[0], args.eval_iters * args.global_batch_size, 0]  # each evaluation reads its first batches
    prefixes, _ = on_every_rank(lambda: check_gpt_data(data_path, args.split, sizes, args.seq_length, needed))
    on_every_rank(lambda: [check_vocabulary(prefix, tokenizer, index_cache) for prefix in prefixes])
    for warning in filter(None, (eod_mismatch(prefix, tokenizer) for prefix in prefixes)):
        log0(warning)
    _warn_about_epochs(args, data_path, sizes)
    train, valid, _test = build_gpt_datasets(
        data_path, tokenizer, args.seq_length, train_samples=sizes[0], valid_samples=sizes[1],
        test_samples=sizes[2], split=args.split, seed=args.seed, path_to_cache=index_cache,
    )
    return tokenizer, train, valid


def data_iterators(dataset, args, layout: ParallelLayout, consumed_samples: int):
    """This data-parallel rank's micro-batches from ``consumed_samples`` on: one
    iterator, or one per model chunk for the interleaved schedule (each chunk reads
    every micro-batch, as in Megatron-LM)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    iterators = [iterate_micro_batches(dataset, args.micro_batch_size, dp_rank, layout.data, consumed_samples,
                                       pin_memory=torch.cuda.is_available())
                 for _ in range(layout.model_chunks)]
    return iterators if layout.virtual else iterators[0]
