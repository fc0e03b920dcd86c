"""Which tokenizer a command line asks for, and building it.

``build_tokenizer`` picks the loader of ``tokenizer.py`` for a type name, or the
default corpus's own tokenizer (``corpus.py``, trained once and cached);
``TokenizerSpec`` is that choice as a picklable value, for worker processes. Its
own module because it uses both: ``corpus`` builds on ``tokenizer``, so neither
of those may import the other back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_sdp4bit.data.corpus import default_tokenizer
from megatron_sdp4bit.data.tokenizer import EOD_TOKEN, Tokenizer, load_gpt2_bpe, load_huggingface

TOKENIZER_TYPES = ("StdlibBPETokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
TOKENIZER_FILES = {"GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
                   "HuggingFaceTokenizer": ("--tokenizer-model",),
                   "StdlibBPETokenizer": ("--tokenizer-model",)}  # (the first that reads a flag is named)
"""The file flags each tokenizer type reads (StdlibBPETokenizer's: an already trained one)."""


def check_tokenizer_files(tokenizer_type: str, given: dict) -> None:
    """A file flag the tokenizer type does not read is refused: ignored, it would leave
    the user believing the run tokenizes with that file. ``given``: flag -> value."""
    unread = [flag for flag, value in given.items()
              if value is not None and flag not in TOKENIZER_FILES.get(tokenizer_type, given)]
    if unread:
        reads = " and ".join(TOKENIZER_FILES[tokenizer_type])
        them = "it" if len(unread) == 1 else "them"
        readers = [kind for kind, flags in TOKENIZER_FILES.items() if set(unread) <= set(flags)]
        instead = f", or pass --tokenizer-type {readers[0]}, which reads {them}" if readers else ""
        raise ValueError(f"--tokenizer-type {tokenizer_type} reads {reads}, not {' or '.join(unread)}: drop "
                         f"{them}{instead}")


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build a tokenizer: what the command line says (picklable, so worker
    processes can rebuild the same tokenizer)."""

    tokenizer_type: str = "StdlibBPETokenizer"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    eod_token: Optional[str] = None
    cache_dir: Optional[str] = None

    def build(self) -> Tokenizer:
        """Load (for the default: train once and cache) the tokenizer."""
        return build_tokenizer(**self.__dict__)


def build_tokenizer(
    tokenizer_type: str = "StdlibBPETokenizer",
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    eod_token: Optional[str] = None,
    cache_dir: Optional[str] = None,
) -> Tokenizer:
    """Build a tokenizer from Megatron-LM-style arguments.

    Args:
        tokenizer_type: one of ``TOKENIZER_TYPES``.
        vocab_file, merge_file: GPT-2 ``vocab.json``/``merges.txt`` (GPT2BPETokenizer).
        tokenizer_model: a ``tokenizer.json`` or a directory holding one
            (HuggingFaceTokenizer; for StdlibBPETokenizer, an already trained one).
        eod_token: overrides the end-of-document token string.
        cache_dir: where the default tokenizer is cached (StdlibBPETokenizer).
    """
    check_tokenizer_files(tokenizer_type, {"--vocab-file": vocab_file, "--merge-file": merge_file,
                                           "--tokenizer-model": tokenizer_model})
    if tokenizer_type == "GPT2BPETokenizer":
        return load_gpt2_bpe(vocab_file, merge_file, eod_token or EOD_TOKEN)
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model PATH (tokenizer.json or its directory).")
        return load_huggingface(tokenizer_model, eod_token)
    if tokenizer_type == "StdlibBPETokenizer":
        if tokenizer_model is not None:
            return load_huggingface(tokenizer_model, eod_token or EOD_TOKEN, name=tokenizer_type)
        tokenizer = default_tokenizer(cache_dir=cache_dir)
        if eod_token not in (None, tokenizer.eod_token):  # checked against its vocabulary
            return load_huggingface(tokenizer.source, eod_token, name=tokenizer_type)
        return tokenizer
    raise ValueError(
        f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}."
    )
