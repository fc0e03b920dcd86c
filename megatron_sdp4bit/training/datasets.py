"""The driver's data: the tokenizer, the train and validation datasets, and the
micro-batch iterators each rank reads (the embedded corpus when no --data-path)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_sdp4bit.data.batches import iterate_micro_batches
from megatron_sdp4bit.data.corpus import load_default_corpus_tokenizer, prepare_default_corpus
from megatron_sdp4bit.data.gpt_datasets import build_gpt_datasets, check_data_path, check_gpt_data
from megatron_sdp4bit.data.tokenizer_types import build_tokenizer
from megatron_sdp4bit.training.agreement import on_every_rank
from megatron_sdp4bit.training.arguments import ArgumentError
from megatron_sdp4bit.training.console import log0
from megatron_sdp4bit.training.distributed import ParallelLayout


def _tokenizer_and_prefixes(args, sizes: list) -> tuple:
    """(tokenizer, data prefixes), the data checked (alike on every rank) before the
    tokenizer is built: a bad file fails fast."""
    def check(data_path):
        on_every_rank(lambda: check_gpt_data(data_path, args.split, sizes))

    if args.data_path:
        on_every_rank(lambda: check_data_path(args.data_path))  # the files first: the commonest mistake
        if args.tokenizer_type is None:
            raise ArgumentError("--data-path needs --tokenizer-type: the tokenizer the data was "
                                "preprocessed with (GPT2BPETokenizer, HuggingFaceTokenizer or "
                                "StdlibBPETokenizer)")
        check(args.data_path)
        tokenizer = build_tokenizer(args.tokenizer_type,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    tokenizer_model=args.tokenizer_model)
        return tokenizer, args.data_path
    if args.tokenizer_type not in (None, "StdlibBPETokenizer"):
        raise ArgumentError("--tokenizer-type needs --data-path (the embedded corpus has its own tokenizer)")
    prefix = prepare_default_corpus(max_mb=args.default_corpus_mb)
    log0(f"data: embedded corpus (Python standard library) at {prefix}")
    check([prefix])
    return load_default_corpus_tokenizer(prefix), [prefix]


def sample_counts(args) -> list:
    """Samples the run reads from the train, validation and test splits. The test
    split is never read (0: not built, so a small corpus need not give it a
    document), nor the validation split with ``--eval-iters 0``."""
    evaluations = args.train_iters // args.eval_interval + 1
    return [args.train_iters * args.global_batch_size,
            evaluations * args.eval_iters * args.global_batch_size, 0]


def build_data(args) -> tuple:
    """(tokenizer, train dataset, validation dataset): as many samples as the run reads."""
    sizes = sample_counts(args)
    tokenizer, data_path = _tokenizer_and_prefixes(args, sizes)
    train, valid, _test = build_gpt_datasets(
        data_path, tokenizer, args.seq_length, train_samples=sizes[0], valid_samples=sizes[1],
        test_samples=sizes[2], split=args.split, seed=args.seed, path_to_cache=args.data_cache_path,
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
