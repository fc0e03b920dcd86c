"""Tokenizers that megatron-core's GPTDataset and our preprocessing both accept.

megatron-core's datasets never tokenize; they only read a handful of attributes
from ``config.tokenizer``: ``vocab_size`` (to pick the token dtype), ``eod`` (the
end-of-document id used for loss/position masks), ``pad`` (optional: when it is
missing megatron uses -1, an id that never occurs in the data) and
``unique_identifiers`` (hashed into the name of the cached sample indices). The
``Tokenizer`` class below provides exactly those plus ``tokenize``/``detokenize``
for preprocessing, on top of the ``tokenizers`` library, so nothing here imports
megatron and nothing needs ``transformers``.

Three kinds, named as Megatron-LM names them on its command line:

- ``GPT2BPETokenizer``: GPT-2 byte-level BPE from the user's ``vocab.json`` and
  ``merges.txt``; EOD is ``<|endoftext|>`` looked up in the vocabulary. As in
  Megatron-LM's own GPT-2 tokenizer, that string in raw text is *not* turned into
  the EOD id (only ``--append-eod`` adds EOD).
- ``HuggingFaceTokenizer``: a local ``tokenizer.json`` (or a directory holding
  one); EOD is ``--eod-token`` or found from ``tokenizer_config.json`` / common
  end-of-text token names.
- ``StdlibBPETokenizer``: the download-free default, a byte-level BPE trained on
  the Python standard library (see ``corpus.py``).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

EOD_TOKEN = "<|endoftext|>"
"""The end-of-document token of GPT-2 and of our default tokenizer."""

# Tried in order when a HuggingFace tokenizer does not say which token ends a
# document; these cover GPT-2/NeoX, Llama 2, Llama 3, Gemma, BERT-style models.
_COMMON_EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the attributes megatron-core datasets read.

    Args:
        backend: the loaded ``tokenizers.Tokenizer``.
        eod_token: the token string that ends a document; must be in the vocab.
        name: the tokenizer type (for messages and the dataset cache key).
        source: the file(s) it was loaded from (for the dataset cache key).
    """

    def __init__(
        self, backend: tokenizers.Tokenizer, eod_token: str, name: str, source: str
    ) -> None:
        eod = backend.token_to_id(eod_token)
        if eod is None:
            raise ValueError(
                f"{name} from {source}: the end-of-document token {eod_token!r} is not "
                "in its vocabulary; pass the right one (e.g. --eod-token)."
            )
        self.backend = backend
        self.name = name
        self.source = source
        self.eod_token = eod_token
        self._eod = eod
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # -- what megatron-core reads -------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (ids are < vocab_size)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The end-of-document id."""
        return self._eod

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """What identifies this tokenizer in megatron's dataset-index cache key."""
        return OrderedDict(
            [
                ("class", self.name),
                ("tokenizer_path", self.source),
                ("eod", str(self._eod)),
                ("vocab_size", str(self._vocab_size)),
            ]
        )

    # -- what preprocessing and users need ---------------------------------------
    @property
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string."""
        return {i: t for t, i in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` (no EOD added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """``[tokenize(t) for t in texts]``, encoded in parallel by the Rust backend."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (EOD) are kept, so byte-level BPE round-trips."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name}, vocab_size={self.vocab_size}, eod={self.eod}, {self.source})"


def _require_file(path: Optional[str], what: str, flag: str) -> str:
    if path is None:
        raise ValueError(f"{what} is required: pass {flag} PATH.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path} (check {flag}).")
    return path


def load_gpt2_bpe(vocab_file: Optional[str], merge_file: Optional[str], eod_token: str = EOD_TOKEN) -> Tokenizer:
    """Megatron-LM's GPT2BPETokenizer: byte-level BPE, GPT-2 pre-tokenization regex,
    no prefix space, no normalization, from the user's vocab.json and merges.txt."""
    vocab_file = _require_file(vocab_file, "GPT2BPETokenizer vocab file", "--vocab-file")
    merge_file = _require_file(merge_file, "GPT2BPETokenizer merge file", "--merge-file")
    try:
        backend = tokenizers.Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as error:  # the Rust loader's messages do not name the files
        raise ValueError(
            f"cannot read GPT-2 BPE files {vocab_file} / {merge_file}: {error}. "
            "--vocab-file must be a vocab.json and --merge-file a merges.txt."
        ) from error
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, eod_token, "GPT2BPETokenizer", f"{vocab_file}|{merge_file}")


def _eod_from_config(directory: str) -> Optional[str]:
    """The ``eos_token`` named in a HuggingFace ``tokenizer_config.json``, if any."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    if isinstance(eos, dict):  # serialized AddedToken
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_huggingface(path: str, eod_token: Optional[str] = None, name: str = "HuggingFaceTokenizer") -> Tokenizer:
    """A HuggingFace fast tokenizer from a local ``tokenizer.json`` or its directory."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer not found: {path} (check --tokenizer-model).")
    directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (
        os.path.dirname(path), path)
    if not os.path.isfile(file):
        raise ValueError(
            f"{path} holds no tokenizer.json; save the tokenizer with "
            "tokenizer.save_pretrained() (fast tokenizers write tokenizer.json) and retry."
        )
    try:
        backend = tokenizers.Tokenizer.from_file(file)
    except Exception as error:
        raise ValueError(f"cannot read {file} as a tokenizers JSON file: {error}") from error
    if eod_token is None:
        eod_token = _eod_from_config(directory)
    if eod_token is None:
        vocab = backend.get_vocab(with_added_tokens=True)
        eod_token = next((t for t in _COMMON_EOD_TOKENS if t in vocab), None)
    if eod_token is None:
        raise ValueError(
            f"cannot tell which token of {file} ends a document; pass --eod-token TOKEN."
        )
    return Tokenizer(backend, eod_token, name, file)
