"""``sdp4bit-preprocess``: text/JSONL -> Megatron indexed dataset (.bin/.idx).

Flag names follow Megatron-LM's ``tools/preprocess_data.py`` and so does the
output name: ``--output-prefix out`` with ``--json-key text`` writes
``out_text_document.bin/.idx``, and ``out_text_document`` is what ``--data-path``
takes. Each document is one sequence; ``--append-eod`` ends it with the EOD id.

Example::

    sdp4bit-preprocess --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json \\
        --merge-file merges.txt --append-eod
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import multiprocessing.pool
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence

from megatron_sdp4bit.data.documents import TEXT_DOCUMENT_UNITS, check_inputs, iter_documents
from megatron_sdp4bit.data.indexed_files import write_indexed_dataset
from megatron_sdp4bit.data.tokenizer import Tokenizer
from megatron_sdp4bit.data.tokenizer_types import TOKENIZER_TYPES, TokenizerSpec

_BATCH_CHARS = 1 << 22  # documents go to the encoder in ~4M-character batches


@dataclass
class PreprocessStats:
    """What one preprocessing run wrote."""

    prefix: str
    documents: int = 0
    tokens: int = 0
    characters: int = 0
    seconds: float = 0.0


def output_prefix_for(output_prefix: str, json_key: str = "text") -> str:
    """Megatron-LM's naming: ``{output_prefix}_{json_key}_document``."""
    return f"{output_prefix}_{json_key}_document"


def _batches(documents: Iterable[str]) -> Iterator[List[str]]:
    batch: List[str] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= _BATCH_CHARS or len(batch) >= 4096:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_worker_tokenizer: Optional[Tokenizer] = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the main process's to handle: it ends the pool
    _worker_tokenizer = spec.build()


def _encode_in_worker(batch: List[str]) -> List[List[int]]:
    return _worker_tokenizer.tokenize_batch(batch)


@contextlib.contextmanager
def encoder_pool(workers: int, spec: TokenizerSpec) -> Iterator[Optional[multiprocessing.pool.Pool]]:
    """``workers`` encoder processes (None for one: the caller encodes), ended on the way out.

    They are started with Ctrl-C ignored, so each one ignores it from its first
    instruction: a Ctrl-C sent to the terminal's whole group while one was still
    starting printed its ``KeyboardInterrupt`` (or ``EOFError``) traceback. An ignored
    signal stays ignored through exec and Python then leaves it so; the main process
    takes Ctrl-C again as soon as they are spawned, before anything is written (one
    pressed in those milliseconds is not seen: press it again).
    """
    if workers <= 1:
        yield None
        return
    start = functools.partial(multiprocessing.get_context("spawn").Pool, workers, _init_worker, (spec,))
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        pool = start()
    else:
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            pool = start()
        finally:
            signal.signal(signal.SIGINT, handler)
    try:
        yield pool
    finally:
        pool.terminate()


def encode_documents(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    append_eod: bool,
    stats: PreprocessStats,
    pool: Optional[multiprocessing.pool.Pool] = None,
) -> Iterator[List[int]]:
    """Token ids of each document, in input order (EOD appended if asked).

    With a ``pool`` (``encoder_pool``) batches are encoded in its processes, each
    rebuilding the tokenizer; the Rust encoder already uses all cores within one
    process, so this mostly helps very large inputs.
    """

    def counted(batches: Iterable[List[str]]) -> Iterator[List[str]]:
        for batch in batches:
            stats.characters += sum(map(len, batch))
            yield batch

    batches = counted(_batches(documents))
    encoded: Iterable[List[List[int]]] = (pool.imap(_encode_in_worker, batches) if pool is not None
                                          else map(tokenizer.tokenize_batch, batches))
    for ids_batch in encoded:
        for ids in ids_batch:
            if append_eod and ids:
                ids.append(tokenizer.eod)
            stats.documents += 1 if ids else 0
            stats.tokens += len(ids)
            yield ids


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    spec: TokenizerSpec = TokenizerSpec(),
    json_key: str = "text",
    append_eod: bool = False,
    text_document_per: str = "file",
    workers: int = 1,
) -> PreprocessStats:
    """Tokenize ``inputs`` into ``{output_prefix}_{json_key}_document.bin/.idx``.

    Empty documents are skipped (as in Megatron-LM, they hold no sequence).
    Returns the counts; ``stats.prefix`` is the ``--data-path`` prefix.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}.")
    if not output_prefix:  # `--output-prefix "$OUT"` with OUT unset
        raise ValueError("--output-prefix was given an empty path (an empty variable?): pass where the data "
                         "goes, e.g. data/my")
    check_inputs(inputs)
    tokenizer = spec.build()  # before any worker starts: trains the default once
    prefix = output_prefix_for(output_prefix, json_key)
    stats = PreprocessStats(prefix)
    start = time.perf_counter()
    documents = iter_documents(inputs, json_key=json_key, per=text_document_per)
    folder = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        why = "a file of that name is in the way" if os.path.isfile(folder) else error.strerror or error
        raise ValueError(f"cannot create the folder of --output-prefix {output_prefix}: {folder} ({why})") from None
    with encoder_pool(workers, spec) as pool:
        ids = encode_documents(documents, tokenizer, append_eod, stats, pool)
        written = write_indexed_dataset(prefix, ids, tokenizer.vocab_size)
    stats.seconds = time.perf_counter() - start
    if written == 0:  # nothing to train on: no pair of files, and an earlier one at PREFIX kept
        raise ValueError(f"no document in {', '.join(inputs)}: the input is empty, or holds only blank "
                         "lines/empty texts; nothing was written")
    return stats


def build_parser() -> argparse.ArgumentParser:
    """The command line (Megatron-LM's flag names where it has them)."""
    p = argparse.ArgumentParser(
        prog="sdp4bit-preprocess",
        description="Tokenize text or JSONL files into a Megatron indexed dataset (.bin/.idx).",
    )
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="text or JSONL (*.jsonl, *.json) files")
    g.add_argument("--json-key", "--json-keys", dest="json_key", default="text",
                   help="JSONL field holding the text (default: text)")
    g.add_argument("--text-document-per", choices=TEXT_DOCUMENT_UNITS, default="file",
                   help="for plain text files: one document per file (default), line or paragraph")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="StdlibBPETokenizer",
                   help="default StdlibBPETokenizer: byte-level BPE trained on the Python stdlib, no download")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    g.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", help="tokenizer.json or its directory (HuggingFaceTokenizer)")
    g.add_argument("--eod-token", help="end-of-document token string (default: the tokenizer's)")
    g.add_argument("--cache-dir", help="cache of the default tokenizer (default: $SDP4BIT_CACHE or ~/.cache/megatron_sdp4bit)")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{json-key}_document.bin/.idx")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    g.add_argument("--workers", type=int, default=1, help="encoder processes (default 1)")
    return p


def driver_flags(prefix: str, spec: TokenizerSpec) -> str:
    """The driver's data flags for what was written, quoted for a shell: ``--data-path``
    alone would be refused (it needs the tokenizer the data was made with), and a
    path with a space would split into two prefixes."""
    flags = ["--data-path", prefix, "--tokenizer-type", spec.tokenizer_type]
    for flag, value in (("--vocab-file", spec.vocab_file), ("--merge-file", spec.merge_file),
                        ("--tokenizer-model", spec.tokenizer_model)):
        if value is not None:
            flags += [flag, value]
    return " ".join(shlex.quote(flag) for flag in flags)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file,
                         args.tokenizer_model, args.eod_token, args.cache_dir)
    try:
        stats = preprocess(args.input, args.output_prefix, spec, args.json_key,
                           args.append_eod, args.text_document_per, args.workers)
    except (ValueError, OSError) as error:
        print(f"sdp4bit-preprocess: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the files are written under temporary names, removed on the way out
        print(f"sdp4bit-preprocess: interrupted (Ctrl-C): nothing was written to {args.output_prefix}",
              file=sys.stderr)
        return 128 + signal.SIGINT
    print(f"wrote {stats.prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens "
          f"from {stats.characters} characters in {stats.seconds:.1f} s")
    print(f"use it with: {driver_flags(stats.prefix, spec)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
