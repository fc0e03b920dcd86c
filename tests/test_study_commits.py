"""megatron_sdp4bit.study_commits: the note under a study's table about the code its runs used."""
from __future__ import annotations

import os
import subprocess

from megatron_sdp4bit.study_commits import commit_note, git_changes_arithmetic, run_commit

A, B, C = "a" * 40, "b" * 40, "c" * 40


def _never(older, newer):
    raise AssertionError("one commit: nothing to compare")


def test_one_clean_commit_needs_no_note():
    assert commit_note([{"commit": A, "dirty": False}] * 3, _never) is None


def test_commits_that_change_the_quantizers_are_named():
    runs = [{"commit": A}, {"commit": A}, {"commit": B}, {"commit": C}]
    asked = []

    def changes(older, newer):
        asked.append((older, newer))
        return (older, newer) == (B, C)  # only B..C touches quant/ or comm/

    note = commit_note(runs, changes)
    assert asked == [(A, B), (B, C)]  # consecutive distinct commits, in the runs' order
    assert "Runs span 3 commits" in note and "bbbbbbb..ccccccc" in note
    assert "aaaaaaa..bbbbbbb" not in note and "rerun" in note


def test_commits_that_leave_the_arithmetic_alone_say_so():
    note = commit_note([{"commit": A}, {"commit": B}], lambda older, newer: False)
    assert "none of them changes the quantizers" in note


def test_unknown_commits_and_dirty_trees_are_reported():
    runs = [{"commit": A, "dirty": True}, {"commit": "unknown"}, {"commit": B + "+dirty"}]
    note = commit_note(runs, lambda older, newer: None)
    assert "not comparable" in note and "2 of 3 runs ran on a tree with uncommitted" in note


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                   check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()


def test_git_tells_which_commits_touch_the_quantizers(tmp_path):
    root = str(tmp_path)
    _git(root, "init", "-q")
    os.makedirs(os.path.join(root, "megatron_sdp4bit", "quant"))
    quant = os.path.join(root, "megatron_sdp4bit", "quant", "reference.py")
    for path, text in ((quant, "noise = 16\n"), (os.path.join(root, "README.md"), "hi\n")):
        with open(path, "w") as f:
            f.write(text)
    first = _git(root, "add", ".") and _git(root, "commit", "-qm", "one")
    with open(os.path.join(root, "README.md"), "a") as f:
        f.write("docs only\n")
    docs = _git(root, "commit", "-qam", "docs")
    with open(quant, "w") as f:
        f.write("noise = 8\n")
    rounding = _git(root, "commit", "-qam", "rounding")
    changes = git_changes_arithmetic(root)
    assert changes(first, docs) is False and changes(docs, rounding) is True
    assert changes(first, "f" * 40) is None  # a commit this clone lacks
    assert run_commit(root) == {"commit": rounding, "dirty": False}
    with open(quant, "a") as f:
        f.write("# edited\n")
    assert run_commit(root) == {"commit": rounding, "dirty": True}
