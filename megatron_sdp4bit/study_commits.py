"""Which code a study's runs ran on, and whether that can change their arithmetic.

A study of many runs (``scripts/reproduce_accuracy.py``) takes hours and may span
commits: each run records the commit it imported and whether the tree had
uncommitted changes (``run_commit``). ``commit_note`` turns those records into the
line printed under the table, so a table whose runs mix code that quantizes
differently says so instead of going stale silently.

"Can change arithmetic" is judged by the files alone: two commits whose
``ARITHMETIC_PATHS`` (the quantizers and the collectives) differ may compute other
numbers (e.g. the rounding noise changed from 16 to 8 random bits per element in
``quant/``); commits that differ only elsewhere (docs, the driver's logging) do not.
The rule is deliberately coarse: a refactoring under ``comm/`` is flagged too, and
the reader then checks that diff.

Only the standard library is imported here.
"""
from __future__ import annotations

import subprocess
from typing import Callable, Iterable, List, Optional, Tuple

from megatron_sdp4bit.jobs import checkout_commit

ARITHMETIC_PATHS = ("megatron_sdp4bit/quant", "megatron_sdp4bit/comm")
"""Where a change can alter what a run computes with the same flags and seed."""

DIRTY = "+dirty"

# (older commit, newer commit) -> True (arithmetic files differ), False (same), None (unknown)
ChangesArithmetic = Callable[[str, str], Optional[bool]]


def run_commit(root: str) -> dict:
    """``{"commit": full hash or "unknown", "dirty": bool}`` of the checkout at ``root``."""
    head = checkout_commit(root, mark_dirty=True)
    return {"commit": head[: -len(DIRTY)] if head.endswith(DIRTY) else head,
            "dirty": head.endswith(DIRTY)}


def git_changes_arithmetic(root: str, paths: Tuple[str, ...] = ARITHMETIC_PATHS) -> ChangesArithmetic:
    """A ``ChangesArithmetic`` asking git in ``root``: ``git diff --quiet A B -- paths``
    (exit 1: they differ; 0: they do not; anything else, e.g. a commit this clone
    lacks: None)."""
    def differ(older: str, newer: str) -> Optional[bool]:
        try:
            code = subprocess.run(["git", "diff", "--quiet", older, newer, "--", *paths],
                                  cwd=root, capture_output=True).returncode
        except OSError:
            return None
        return {0: False, 1: True}.get(code)

    return differ


def _short(commit: str) -> str:
    return commit[:7] if commit != "unknown" else commit


def commit_note(runs: Iterable[dict], changes_arithmetic: ChangesArithmetic) -> Optional[str]:
    """What the table's reader must know about the code its runs used; None when every
    run used one clean commit.

    ``runs``: the results in the order they finished, each with ``commit`` (and
    ``dirty``, absent in results written before it was recorded). Consecutive
    distinct commits are compared with ``changes_arithmetic``."""
    runs = list(runs)
    commits: List[str] = []
    for run in runs:
        commit = run.get("commit") or "unknown"
        if commit.endswith(DIRTY):  # an older record format
            commit = commit[: -len(DIRTY)]
        if commit not in commits:
            commits.append(commit)
    dirty = sum(1 for run in runs if run.get("dirty") or str(run.get("commit", "")).endswith(DIRTY))
    lines = []
    if len(commits) > 1:
        changed, unknown = [], []
        for older, newer in zip(commits, commits[1:]):
            verdict = None if "unknown" in (older, newer) else changes_arithmetic(older, newer)
            span = f"{_short(older)}..{_short(newer)}"
            if verdict is None:
                unknown.append(span)
            elif verdict:
                changed.append(span)
        text = (f"**Runs span {len(commits)} commits** ({', '.join(_short(c) for c in commits)}, "
                "in the order the runs finished)")
        if changed:
            text += (f"; the quantizers or collectives ({', '.join(ARITHMETIC_PATHS)}) change in "
                     f"{', '.join(changed)}: runs on either side may not compute alike, rerun the "
                     "older ones")
        elif not unknown:
            text += "; none of them changes the quantizers or collectives"
        if unknown:
            text += f"; not comparable here (a commit this clone lacks): {', '.join(unknown)}"
        lines.append(text + ".")
    if dirty:
        lines.append(f"**{dirty} of {len(runs)} runs ran on a tree with uncommitted changes**: "
                     "their code is not the commit they name.")
    return "\n".join(lines) or None
