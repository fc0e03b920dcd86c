"""``scripts/pretrain_gpt.sh`` runs the project's Python, not whatever ``python`` PATH
finds first, and refuses one that cannot import the package in one line (issue 28).

The script is copied into a bare checkout layout (scripts/, configs/, optionally
.venv/bin/python) so the test decides what its checkout holds. A run that gets as
far as the layout check (6.7b's TP 4 on 6 GPUs per node) has read its config with
the chosen Python; nothing is launched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_exe(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path):
    """A checkout with the script and one config, and a PATH whose python/python3 is
    not the project's (it cannot import anything of it)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "configs").mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "pretrain_gpt.sh"), root / "scripts")
    shutil.copy(os.path.join(REPO, "configs", "gpt_6.7b.yaml"), root / "configs")
    bin_dir = tmp_path / "bin"
    for name in ("python", "python3"):
        _write_exe(bin_dir / name, "#!/bin/sh\nexec /usr/bin/env -i /bin/false\n")
    return root, bin_dir


def _run(root, bin_dir, **env):
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "GPUS_PER_NODE": "6", "HOME": str(root), **env}
    return subprocess.run(["bash", str(root / "scripts" / "pretrain_gpt.sh"), "6.7b"], capture_output=True,
                          text=True, timeout=300, env=environment)


def _project_python(path):
    """A stand-in for the checkout's .venv/bin/python: this test's interpreter, seeing the package."""
    _write_exe(path, f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} \"$@\"\n")


def test_the_checkouts_venv_is_used_before_path(checkout):
    """Before: ``python`` from PATH read the config and failed (``could not read the
    parallel sizes``) though the checkout's .venv had everything."""
    root, bin_dir = checkout
    _project_python(root / ".venv" / "bin" / "python")
    done = _run(root, bin_dir)
    assert done.returncode == 2
    assert done.stderr.strip() == ("6.7b: --tensor-model-parallel-size 4 does not divide the 6 GPUs of a node "
                                   "(tensor parallelism stays inside a node); set GPUS_PER_NODE or pass "
                                   "another size")


def test_a_python_without_the_package_is_refused_in_one_line(checkout, tmp_path):
    root, bin_dir = checkout
    done = _run(root, bin_dir)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"pretrain_gpt.sh: error: {bin_dir / 'python3'} cannot import megatron_sdp4bit")
    assert "make setup" in line and "PYTHON" in line
    _project_python(tmp_path / "mine" / "python")  # the fix it names: PYTHON=...
    assert "does not divide the 6 GPUs" in _run(root, bin_dir, PYTHON=str(tmp_path / "mine" / "python")).stderr
