"""Read documents (strings) from text and JSONL files, streaming, in a fixed order.

- ``*.jsonl`` / ``*.json``: one JSON object per line (Megatron-LM's input format);
  the document is ``obj[json_key]``. Blank lines are skipped.
- anything else: UTF-8 text; ``per`` says what one document is: the whole
  ``file`` (default), each non-empty ``line``, or each ``paragraph`` (runs of
  lines separated by blank lines).
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, List

TEXT_DOCUMENT_UNITS = ("file", "line", "paragraph")
JSONL_SUFFIXES = (".jsonl", ".json")


def is_jsonl(path: str) -> bool:
    """Whether ``path`` is read as JSON lines (by its suffix)."""
    return path.lower().endswith(JSONL_SUFFIXES)


def check_inputs(paths: Iterable[str]) -> List[str]:
    """The input paths, after checking each is a readable file."""
    paths = list(paths)
    if not paths:
        raise ValueError("no input files: pass --input FILE [FILE ...].")
    for path in paths:
        if os.path.isdir(path):
            raise ValueError(f"--input {path} is a directory; pass the files in it (e.g. {path}/*.jsonl).")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input file not found: {path}")
    return paths


def _jsonl_documents(path: str, json_key: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where} is not UTF-8 text ({error.reason} at byte {error.start} of the "
                                 "line); convert the file to UTF-8.") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not valid JSON ({error}); each line must be one JSON object.") from None
            if not isinstance(record, dict) or json_key not in record:
                raise ValueError(f"{where} has no key {json_key!r}; pass the right --json-key.")
            text = record[json_key]
            if not isinstance(text, str):
                raise ValueError(f"{where}: {json_key!r} holds a {type(text).__name__}, not text.")
            yield text


def _paragraphs(f: Iterable[str]) -> Iterator[str]:
    lines: List[str] = []
    for line in f:
        if line.strip():
            lines.append(line)
        elif lines:
            yield "".join(lines).rstrip("\n")
            lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _text_documents(path: str, per: str) -> Iterator[str]:
    try:
        if per == "file":  # the file exactly as it is, "\r\n" included
            with open(path, encoding="utf-8", newline="") as f:
                yield f.read()
            return
        with open(path, encoding="utf-8") as f:
            if per == "line":
                for line in f:
                    if line.strip():
                        yield line.rstrip("\n")
            else:
                yield from _paragraphs(f)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error}); convert it to UTF-8.") from None


def iter_documents(paths: Iterable[str], json_key: str = "text", per: str = "file") -> Iterator[str]:
    """Yield every document of ``paths``, in the order given."""
    if per not in TEXT_DOCUMENT_UNITS:
        raise ValueError(f"unknown text document unit {per!r}; choose one of {TEXT_DOCUMENT_UNITS}.")
    for path in check_inputs(paths):
        if is_jsonl(path):
            yield from _jsonl_documents(path, json_key)
        else:
            yield from _text_documents(path, per)
