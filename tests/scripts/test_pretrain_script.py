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


def _run(root, bin_dir, *flags, **env):
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "GPUS_PER_NODE": "6", "HOME": str(root), **env}
    return subprocess.run(["bash", str(root / "scripts" / "pretrain_gpt.sh"), "6.7b", *flags], capture_output=True,
                          text=True, timeout=120, env=environment)


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
    assert done.stderr.strip() == ("pretrain_gpt.sh: error: 6.7b: --tensor-model-parallel-size 4 does not divide "
                                   "the 6 GPUs of a node (tensor parallelism stays inside a node); set "
                                   "GPUS_PER_NODE or pass another size")


def test_a_python_without_the_package_is_refused_in_one_line(checkout, tmp_path):
    root, bin_dir = checkout
    done = _run(root, bin_dir)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"pretrain_gpt.sh: error: {bin_dir / 'python3'} cannot import megatron_sdp4bit")
    assert "make setup" in line and "PYTHON" in line
    _project_python(tmp_path / "mine" / "python")  # the fix it names: PYTHON=...
    assert "does not divide the 6 GPUs" in _run(root, bin_dir, PYTHON=str(tmp_path / "mine" / "python")).stderr


# --- what the script checks before torchrun starts (megatron_sdp4bit/gpt_launch.py) ---------

CONFIGS = os.path.join(REPO, "configs")


@pytest.mark.parametrize("size, argv, env, line", [
    ("125M", [], {}, "no config for size '125M' ({configs}/gpt_125M.yaml): choose one of 1.3b, 125m, 2.7b, 350m, "
     "6.7b"),
    ("125m", ["--tensor-model-parallel-size", "abc"], {},
     "argument --tensor-model-parallel-size: must be an integer >= 1, got 'abc'"),
    ("125m", ["--tensor-model-parallel-size", "0"], {}, "argument --tensor-model-parallel-size: must be an integer "
     ">= 1, got '0'"),
    ("125m", ["--lrr", "1"], {}, "unrecognized arguments: --lrr 1; did you mean --lr?"),
    ("125m", [], {"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE='0' is not an integer >= 1"),
    ("125m", [], {"GPUS_PER_NODE": "abc"}, "GPUS_PER_NODE='abc' is not an integer >= 1"),
    ("125m", [], {"NNODES": "2"}, "NNODES=2 needs MASTER_ADDR (the first node's address, the same on every node) "
     "and NODE_RANK (this node's, 0 to 1); without them every node would wait for the others on its own localhost"),
    ("125m", [], {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "n0"}, "NODE_RANK=2 is not below NNODES=2: the "
     "nodes are 0 to 1"),
    ("125m", ["--config", "configs/gpt_350m.yaml"], {}, "--config: pretrain_gpt.sh 125m reads "
     "{configs}/gpt_125m.yaml, which another --config would replace: pass the flags to change, or run the driver "
     "on your file (torchrun ... -m megatron_sdp4bit.pretrain --config FILE)"),
    ("125m", [], {"GPUS_PER_NODE": "3"}, "--global-batch-size 256 is not divisible by --micro-batch-size 8 x "
     "data-parallel size 3 = 24"),
])
def test_what_torchrun_would_start_every_rank_for_is_refused_first(capsys, size, argv, env, line):
    """Issue 28, round two. Before: a TP of 'abc' was a Python traceback and 0 bash's
    'division by 0', after which torchrun started anyway; GPUS_PER_NODE=0 started 0
    ranks; NNODES=2 without MASTER_ADDR/NODE_RANK started every node as node 0 on its
    own localhost, to wait for the others; '--config' replaced the size's config
    silently, with the size's TP and PP printed; a typo'd flag or a global batch that
    does not divide was refused by every rank after start-up."""
    from megatron_sdp4bit import gpt_launch

    with pytest.MonkeyPatch.context() as mp:
        for name in ("GPUS_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(name, raising=False)
        mp.setenv("GPUS_PER_NODE", "8")
        for name, value in env.items():
            mp.setenv(name, value)
        assert gpt_launch.main([CONFIGS, size, *argv]) == 2
    assert capsys.readouterr().err.strip() == f"pretrain_gpt.sh: error: {line.format(configs=CONFIGS)}"


@pytest.mark.parametrize("env, flags", [
    ({}, ["--standalone", "--nproc-per-node=8"]),  # one node: a free port, not 29500 for every job
    ({"NNODES": "4", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
     ["--nnodes", "4", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500",
      "--nproc-per-node=8"]),
    ({"MASTER_PORT": "29511"}, ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                                "--master-port", "29511", "--nproc-per-node=8"]),
])
def test_the_node_flags_and_the_layout_it_prints(capsys, env, flags):
    from megatron_sdp4bit import gpt_launch

    with pytest.MonkeyPatch.context() as mp:
        for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(name, raising=False)
        mp.setenv("GPUS_PER_NODE", "8")
        for name, value in env.items():
            mp.setenv(name, value)
        assert gpt_launch.main([CONFIGS, "6.7b", "--data-path", "d"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == flags
    nodes = int(env.get("NNODES", 1))
    assert err.strip() == f"GPT-6.7b: TP 4 x PP 1 x DP {2 * nodes} on {nodes} node(s) x 8 GPUs"


def test_the_script_refuses_them_in_one_line_before_torchrun(checkout):
    """Through the script itself: before, ``NNODES=2`` alone started torchrun as node 0 of
    2 on 127.0.0.1, which waited for a node that would never come (cut here by the
    timeout), and a TP of 'abc' printed a Python traceback."""
    root, bin_dir = checkout
    _project_python(root / ".venv" / "bin" / "python")
    alone = _run(root, bin_dir, "--data-path", "d", GPUS_PER_NODE="8", NNODES="2")
    assert alone.returncode == 2 and alone.stderr.strip().startswith(
        "pretrain_gpt.sh: error: NNODES=2 needs MASTER_ADDR"), alone.stderr[-2000:]
    bad = _run(root, bin_dir, "--tensor-model-parallel-size", "abc", GPUS_PER_NODE="8")
    assert (bad.returncode, bad.stderr.strip()) == (2, "pretrain_gpt.sh: error: argument "
                                                    "--tensor-model-parallel-size: must be an integer >= 1, got 'abc'")
