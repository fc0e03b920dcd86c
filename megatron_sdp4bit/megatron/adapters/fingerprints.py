"""Fingerprints of the megatron functions the package wraps, replaces or copies.

Each adapter lists its release's seams (``MegatronAdapter.seams``): the megatron
functions whose code the package depends on beyond their name, each as a ``Seam``
named ``"module:qualname"`` (or ``"path/file.cpp:function"`` for the C++ the dataset
helpers' NumPy twins copy). A fingerprint is a short hash of one function's code as
the release ships it, read from the source text without importing megatron:

- Python: the function's syntax tree without docstrings (comments, blank lines and
  formatting are not in the tree), written out field by field, leaving out empty
  fields, so the hash does not depend on the Python version that parses it.
- C++: the function's text from its name to its closing brace, comments removed and
  white space squeezed out.

``tests/megatron/megatron_fingerprints.json`` holds the fingerprints of every seam for
every supported release; a release whose source differs fails there, naming the
function. ``scripts/megatron_fingerprints.py`` recomputes that table from the
releases' wheels (docs/megatron.md, "Fingerprints of megatron's functions").
"""
from __future__ import annotations

import ast
import copy
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional

ABSENT = None
"""The fingerprint of a seam the release does not have (module or function missing)."""

HOW = ("replaces", "wraps", "copies", "mirrors")
"""``replaces``: another function takes its place; ``wraps``: it runs inside one of the
package's; ``copies``: the package repeats its code or arithmetic; ``mirrors``: the
package keeps the state it reads or writes (handles, flags) as it does."""


@dataclass(frozen=True)
class Seam:
    """One megatron function the package depends on beyond its name."""

    name: str
    """``"megatron.core.module:Class.method"``, or ``"megatron/core/x/file.cpp:function"``."""
    how: str
    """One of ``HOW``."""
    where: str
    """The package's file that does it, relative to ``megatron_sdp4bit/``."""

    def __post_init__(self) -> None:
        if ":" not in self.name:
            raise ValueError(f"Seam.name {self.name!r}: write it as 'module:qualname'")
        if self.how not in HOW:
            raise ValueError(f"Seam.how {self.how!r} of {self.name}: use one of {', '.join(HOW)}")

    @property
    def source_paths(self) -> tuple:
        """Where the function's file may be, relative to site-packages."""
        location = self.name.split(":", 1)[0]
        if location.endswith(".cpp"):
            return (location,)
        stem = location.replace(".", "/")
        return (f"{stem}.py", f"{stem}/__init__.py")

    @property
    def qualname(self) -> str:
        return self.name.split(":", 1)[1]


# ------------------------------------------------------------------ normalizers


def _without_docstrings(node: ast.AST) -> ast.AST:
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = inner.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                inner.body = body[1:] or [ast.Pass()]
    return node


def _canonical(value) -> str:
    """``ast.dump`` without the fields a Python version may add empty (``type_params``)."""
    if isinstance(value, ast.AST):
        fields = [f"{name}={_canonical(getattr(value, name))}" for name in value._fields
                  if getattr(value, name, None) not in (None, [])]
        return f"{type(value).__name__}({','.join(fields)})"
    if isinstance(value, list):
        return f"[{','.join(_canonical(item) for item in value)}]"
    return repr(value)


def _find_definition(body: Iterable[ast.stmt], name: str) -> Optional[ast.AST]:
    """The last definition of ``name`` among these statements (as Python binds it),
    looking into ``if``/``try`` blocks (conditional definitions) but not into functions."""
    found = None
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and statement.name == name:
            found = statement
        elif isinstance(statement, (ast.If, ast.Try)):
            blocks = [statement.body, statement.orelse] + [getattr(statement, "finalbody", [])] \
                + [handler.body for handler in getattr(statement, "handlers", [])]
            for block in blocks:
                inner = _find_definition(block, name)
                if inner is not None:
                    found = inner
    return found


def python_fingerprint(source, qualname: str) -> Optional[str]:
    """The fingerprint of ``qualname`` (``"function"`` or ``"Class.method"``) in a module's
    source text (or its parsed tree); ``ABSENT`` when the module does not define it."""
    node: Optional[ast.AST] = ast.parse(source) if isinstance(source, str) else source
    for part in qualname.split("."):
        node = _find_definition(node.body, part)
        if node is None:
            return ABSENT
    return _digest(_canonical(_without_docstrings(copy.deepcopy(node))))


def cpp_fingerprint(source: str, name: str) -> Optional[str]:
    """The fingerprint of C++ function ``name`` (its definition, not a call) in a file's text."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    match = re.search(rf"\b{re.escape(name)}\s*\([^;{{}}]*\)\s*\{{", text)
    if match is None:
        return ABSENT
    depth, end = 0, None
    for index in range(match.end() - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            end = index + 1
            break
    if end is None:
        return ABSENT
    squeezed = re.sub(r"\s*([^\w\s])\s*", r"\1", re.sub(r"\s+", " ", text[match.start():end]))
    return _digest(squeezed)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprints(seams: Iterable[Seam], read: Callable[[str], Optional[str]]) -> Dict[str, Optional[str]]:
    """``{seam name: fingerprint}``, sorted by name, in the release whose files
    ``read(relative path)`` returns (None for a file the release does not have). Each
    file is read and parsed once."""
    files: Dict[str, object] = {}

    def parsed(path: str):
        if path not in files:
            source = read(path)
            files[path] = source if source is None or path.endswith(".cpp") else ast.parse(source)
        return files[path]

    def one(seam: Seam) -> Optional[str]:
        for path in seam.source_paths:
            source = parsed(path)
            if source is not None:
                return (cpp_fingerprint if path.endswith(".cpp") else python_fingerprint)(source, seam.qualname)
        return ABSENT

    return {seam.name: one(seam) for seam in sorted(seams, key=lambda s: s.name)}


# ---------------------------------------------------------------- source readers


def installed_reader() -> Callable[[str], Optional[str]]:
    """Reads the installed megatron-core's files without importing any of it: those its
    distribution installed (so a Megatron-LM checkout on ``sys.path`` does not mix in),
    else, for a source checkout, the files of the ``megatron`` package Python finds."""
    try:
        distribution = importlib.metadata.distribution("megatron-core")
        installed = {str(path) for path in distribution.files or ()}
    except importlib.metadata.PackageNotFoundError:
        distribution, installed = None, set()
    if "megatron/core/__init__.py" in installed:
        def locate(relative: str) -> Optional[str]:
            return str(distribution.locate_file(relative)) if relative in installed else None
    else:
        spec = importlib.util.find_spec("megatron")
        roots = [os.path.dirname(location) for location in (spec.submodule_search_locations or [])] if spec else []

        def locate(relative: str) -> Optional[str]:
            return next((os.path.join(root, relative) for root in roots
                         if os.path.isfile(os.path.join(root, relative))), None)

    def read(relative: str) -> Optional[str]:
        path = locate(relative)
        if path is None or not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as file:
            return file.read()

    return read


def wheel_reader(wheel_path: str) -> Callable[[str], Optional[str]]:
    """Reads the files of a megatron-core wheel (``pip download megatron-core==X``)."""
    archive = zipfile.ZipFile(wheel_path)
    names = set(archive.namelist())

    def read(relative: str) -> Optional[str]:
        return archive.read(relative).decode("utf-8") if relative in names else None

    return read


def wheel_version(wheel_path: str) -> str:
    """``megatron_core-0.17.1-cp311-...whl`` -> ``"0.17.1"`` (the wheel file name's rule)."""
    return os.path.basename(wheel_path).split("-")[1]


# ------------------------------------------------------------------- the table

TABLE = "tests/megatron/megatron_fingerprints.json"
"""Where the fingerprints of every supported release are kept, relative to the repository."""

UPDATE = "python scripts/megatron_fingerprints.py --installed"
"""The command that records the installed release's fingerprints in ``TABLE``."""


def release_fingerprints(version: str, read: Callable[[str], Optional[str]]) -> Dict[str, Optional[str]]:
    """The fingerprints of every seam of ``version``'s adapter, from that release's files."""
    from megatron_sdp4bit.megatron.adapters import adapter_for  # the adapters import this module

    return fingerprints(adapter_for(version).seams, read)


def differences(version: str, recorded: Optional[Dict[str, Optional[str]]], seams: Iterable[Seam],
                read: Callable[[str], Optional[str]]) -> list:
    """One line per seam whose code in this release differs from ``recorded`` (the table's
    entry for ``version``; None if it has none), or that the entry lacks or has too many."""
    if recorded is None:
        return [f"megatron-core {version} has no fingerprints in {TABLE}: review every seam "
                f"(docs/megatron.md, \"Fingerprints of megatron's functions\"), then `{UPDATE}`"]
    seams = list(seams)
    found_all = fingerprints(seams, read)
    lines = []
    for seam in seams:
        if seam.name not in recorded:
            lines.append(f"{TABLE} has no fingerprint of {seam.name} for megatron-core {version}: `{UPDATE}`")
            continue
        found = found_all[seam.name]
        if found != recorded[seam.name]:
            change = {ABSENT: "removed"}.get(found, "added" if recorded[seam.name] is ABSENT else "changed")
            lines.append(f"megatron-core {version} {change} {seam.name} (the package {seam.how} it in "
                         f"megatron_sdp4bit/{seam.where}): review that code, then `{UPDATE}`")
    listed = {seam.name for seam in seams}
    lines += [f"{TABLE} fingerprints {name} for megatron-core {version}, which no seam of its adapter "
              f"names: `{UPDATE}`" for name in sorted(set(recorded) - listed)]
    return lines
