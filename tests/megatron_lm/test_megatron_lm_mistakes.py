"""Mistakes a user of the Megatron-LM route makes, each ending in one line or set right.

Megatron-LM's own loop on CPU ranks (``SDP4BIT_CPU=1``, the megatron-core 0.19.2 wheel's
``megatron.training``), with the minimal pre-training script of
``test_megatron_training_loop.py`` (issue 28):

- what would fail later is refused when the flags are parsed, one line from rank 0, exit
  code 2: no distributed optimizer, a checkpoint format without the layer's state, torch
  FSDP2, and Megatron-LM's own ``validate_args`` asserts (``--overlap-param-gather``
  without ``--overlap-grad-reduce``);
- the CPU mode sets what a CPU run needs (``--transformer-impl local``, the fused kernels
  off) and says so once; 2 ranks on one node report the error of the hop that ran only;
- a patched script started without the launcher under ``SDP4BIT_CPU=1`` is refused;
- the launcher without torchrun runs one process and says that one data-parallel rank
  quantizes nothing.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

from harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str):
    """The training-loop test's script, arguments and launch helpers (one copy of each)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOOP = _sibling("test_megatron_training_loop")
pytestmark = LOOP.pytestmark


# ---------------------------------------------------------------- refused before training

def _without(args, *flags):
    """``args`` without each of ``flags`` (and the value after a flag that takes one)."""
    kept, skip = [], False
    for position, arg in enumerate(args):
        if skip:
            skip = False
        elif arg in flags:
            skip = position + 1 < len(args) and not args[position + 1].startswith("--")
        else:
            kept.append(arg)
    return kept


@pytest.mark.parametrize("drop, add, message", [
    (["--use-distributed-optimizer"], [], "error: SDP4Bit quantizes the distributed optimizer's"),
    ([], ["--save", "ckpt", "--ckpt-format", "torch_dcp"], "error: --ckpt-format torch_dcp: SDP4Bit's state"),
    # Before: told to add --use-distributed-optimizer, which Megatron-LM rejects with FSDP2.
    (["--use-distributed-optimizer"], ["--use-torch-fsdp2"], "error: SDP4Bit does not support torch FSDP2"),
    # Megatron-LM's own check (an AssertionError traceback on every rank before).
    (["--overlap-grad-reduce"], [], "error: Megatron-LM refuses these arguments: Must use "
                                    "--overlap-param-gather with --overlap-grad-reduce (arguments.py:"),
    # a runner the CPU ranks cannot serve (a traceback after initialization, or unused, before)
    ([], ["--sdp4bit-runner", "stream"], "error: --sdp4bit-runner stream cannot run here: its side "
                                         "stream is a CUDA stream, and this job's gradients are on cpu"),
])
def test_what_would_fail_later_is_refused_before_anything_starts(tmp_path, drop, add, message):
    """Before: a RuntimeError traceback on every rank after initialization (no distributed
    optimizer), or a checkpoint without the layer's state."""
    args = [*_without(LOOP.MEGATRON_LM_ARGS, *drop), *add, *LOOP.SDP4BIT_ARGS]
    line = LOOP._refused_line(LOOP._launch(tmp_path, args, nproc=2))
    assert line.startswith(message), line


# ---------------------------------------------------------------- what CPU needs, set once

GPU_ONLY_FLAGS = ("--transformer-impl", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                  "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                  "--no-rope-fusion")


def test_cpu_mode_sets_what_a_cpu_run_needs_in_one_line(tmp_path):
    """Without --transformer-impl local and the six --no-*-fusion / --no-persist-layer-norm
    flags, every rank died (TypeError or AssertionError tracebacks); now the CPU mode sets
    them and rank 0 says so once. 2 ranks on one node: only the 8-bit intra-node hop runs,
    and only its error is reported (before: grad_inter too, a hop that never ran)."""
    args = [*_without(LOOP.MEGATRON_LM_ARGS, *GPU_ONLY_FLAGS), *LOOP.SDP4BIT_ARGS]
    args[args.index("--train-iters") + 1] = "3"
    result = LOOP._launch(tmp_path, args, nproc=2)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    said = [line for line in output.splitlines() if line.startswith("CPU mode (SDP4BIT_CPU=1): ")]
    assert said == ["CPU mode (SDP4BIT_CPU=1): --transformer-impl local --no-persist-layer-norm "
                    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
                    "--no-bias-dropout-fusion --no-rope-fusion --distributed-backend gloo (Transformer Engine, "
                    "Apex and the fused kernels are GPU code)"], said
    lines = [line for line in output.splitlines() if " iteration " in line and "lm loss" in line]
    assert len(lines) == 3, output[-4000:]
    assert all("sdp4bit grad_intra error: " in line and "grad_inter" not in line for line in lines), lines
    assert "grad_inter" not in output.split("=== SDP4Bit summary")[1], output[-2000:]


# ---------------------------------------------------------------- the patch route on CPU

PATCHED_SCRIPT_MAIN = """
    from megatron_sdp4bit.megatron_lm import extend_args_provider, install_from_args

    if __name__ == "__main__":  # as the core_v0.19.0 patch edits pretrain_gpt.py
        datasets_provider.is_distributed = True
        args = parse_and_validate_args(extra_args_provider=extend_args_provider())
        install_from_args(args)
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider,
                 ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
"""


def test_sdp4bit_cpu_on_the_patch_route_without_the_launcher_is_one_line(tmp_path):
    """A patched script started directly (``torchrun pretrain_gpt.py``) cannot have the CPU
    mode: before, SDP4BIT_CPU=1 was silently ignored and every rank died wanting CUDA."""
    script = tmp_path / "pretrain_patched.py"
    # The test script's own module-level enable_cpu_training() (a check of the launcher's) is
    # what a user's pretrain_gpt.py does not have.
    header = LOOP.SCRIPT[:LOOP.SCRIPT.index("\nif __name__")].replace("cpu_backend.enable_cpu_training()", "pass")
    script.write_text(header + textwrap.dedent(PATCHED_SCRIPT_MAIN))
    env = dict(os.environ, SDP4BIT_CPU="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([LOOP.ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--monitor-interval", "0.1", str(script),
           *LOOP.MEGATRON_LM_ARGS, *LOOP.SDP4BIT_ARGS]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    line = LOOP._refused_line(result)
    assert line.startswith("error: SDP4BIT_CPU=1 is read by the launcher only"), line
    assert "megatron_sdp4bit.launch" in line


def test_the_launcher_without_torchrun_runs_one_process_and_says_so(tmp_path):
    """``python -m megatron_sdp4bit.launch`` without torchrun: before, Megatron-LM died in
    init_process_group ("environment variable MASTER_ADDR expected", a traceback). Now one
    process trains, and both lines say that one data-parallel rank quantizes nothing."""
    script = tmp_path / "pretrain_tiny_gpt.py"
    script.write_text(LOOP.SCRIPT)
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(SDP4BIT_CPU="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", REPORT_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([LOOP.ROOT, os.environ.get("PYTHONPATH", "")]))
    args = [*LOOP.MEGATRON_LM_ARGS, "--sdp4bit", "--sdp4bit-check-interval", "1"]
    args[args.index("--train-iters") + 1] = "2"
    result = subprocess.run([sys.executable, "-m", "megatron_sdp4bit.launch", str(script), *args],
                            capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert output.count("megatron_sdp4bit.launch: not started by torchrun: one process (MASTER_ADDR=127.0.0.1 "
                        "MASTER_PORT=") == 1, output[-4000:]
    assert output.count("sdp4bit: data-parallel size 1: nothing to quantize") == 1, output[-4000:]
    assert len(re.findall(r"\| lm loss: ([0-9.Ee+-]+) \|", output)) == 2, output[-4000:]
