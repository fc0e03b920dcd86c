"""Megatron-LM's checkpoints carry the SDP4Bit layer, and its log shows the layer.

Through ``megatron.training.pretrain`` on CPU (``SDP4BIT_CPU=1``, gloo, 4 ranks, DP 4 as
2 emulated nodes x 2), with the launcher (``python -m megatron_sdp4bit.launch``) and the
minimal pre-training script of ``test_megatron_training_loop.py``:

- 2N iterations in one run, and N iterations saved (``--save``, ``--exit-interval N``)
  then resumed (``--load``) for N more, give the same losses (Megatron-LM's iteration
  lines) and bit-identical weights (SHA-256 per rank), for ``--ckpt-format torch`` and
  ``torch_dist``. The run is one the layer's state decides: fp32 parameters (qWD keeps
  the exact main shards, megatron saves the reconstructed ones), stochastic rounding,
  and ``--sdp4bit-grad-start-iter`` after the save (a resume that forgot the step count
  would wait N more steps before quantizing the gradients);
- with ``--overlap-param-gather``, N saved + N resumed equal a straight run that also
  saved at N (a save changes the overlapped gathers' noise, see below), bit for bit;
- a resume of that checkpoint on 2 ranks (another data-parallel size) is refused in one
  line, from one rank, before training;
- the iteration lines carry the bytes sent vs exact, the replica checks and the sampled
  quantization errors; rank 0 prints the install line once; the last rank prints the
  summary.

``layer_state_for_resume`` (which saved file each rank takes, and when another size is
refused) is checked on files the test writes, without megatron.

Needs ``megatron.training`` (the megatron-core 0.19.2 wheel ships it; 0.16.1's does not).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _sibling(name: str):
    """The training-loop test's script and arguments (one copy of the script)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOOP = _sibling("test_megatron_training_loop")

N = 3
# No dropout: in CPU mode a resumed run's dropout masks differ from the straight run's even
# without SDP4Bit (the "CUDA generator" is the CPU one, which something between the load and
# the first step draws from; docs/megatron.md, "Checkpoints").
# No --overlap-param-gather: the weight gathers then run in the optimizer step, in one
# order. Overlapped, they run in the forward pass, first needed first, but a save forces
# them all at once in bucket order; with stochastic rounding they draw from one stream per
# rank, so the save itself changes which noise each bucket gets (the resumed run equals a
# straight run that saved at N, not one that did not: tested below with the flag).
FP32_ARGS = [a for a in LOOP.MEGATRON_LM_ARGS if a not in ("--bf16", "--overlap-param-gather")] + [
    "--hidden-dropout", "0", "--attention-dropout", "0"]
FP32_ARGS[FP32_ARGS.index("--train-iters") + 1] = str(2 * N)
SDP4BIT_ARGS = [*LOOP.SDP4BIT_ARGS, "--sdp4bit-grad-start-iter", str(N + 1)]

needs_loop = [
    pytest.mark.skipif(not LOOP._megatron_training_importable(),
                       reason="megatron.training (Megatron-LM's training loop) is not importable here; the "
                              "megatron-core 0.19.2 wheel ships it (0.16.1's does not): make test MCORE=0.19.2"),
    pytest.mark.skipif(LOOP._megatron_training_importable() and not LOOP._cpu_training_known(),
                       reason="the CPU mode for megatron.training knows megatron-core 0.19's loop only"),
]


def _launch(tmp_path, name: str, ranks: int, extra_args):
    """One job: (exit code, output, Megatron-LM's losses by iteration, reports by rank)."""
    folder = tmp_path / name
    folder.mkdir()
    script = tmp_path / "pretrain_tiny_gpt.py"
    script.write_text(LOOP.SCRIPT)
    env = dict(os.environ, SDP4BIT_CPU="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               CUDA_DEVICE_MAX_CONNECTIONS="1", REPORT_DIR=str(folder),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "megatron_sdp4bit.launch", str(script), *FP32_ARGS, *extra_args, *SDP4BIT_ARGS]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(folder))
    output = result.stdout + result.stderr
    losses = {int(i): float(x) for i, x in
              re.findall(r" iteration +(\d+)/ *\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|", output)}
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in folder.glob("rank*.json")}
    return result.returncode, output, losses, reports


def _ok(run):
    code, output, losses, reports = run
    if code != 0:
        failed = [line for line in output.splitlines() if re.match(r"\[rank\d\]:", line)]
        pytest.fail("training failed:\n" + ("\n".join(failed[-60:]) or output[-6000:]))
    return output, losses, reports


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """2N iterations in one run."""
    return _ok(_launch(tmp_path_factory.mktemp("straight"), "run", 4, []))


def _save_and_resume(tmp_path, ckpt_format: str):
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", str(N), "--exit-interval", str(N),
            "--ckpt-format", ckpt_format]
    first = _ok(_launch(tmp_path, "first", 4, save))
    second = _ok(_launch(tmp_path, "second", 4, ["--load", str(tmp_path / "ckpt"), "--ckpt-format", ckpt_format]))
    return first, second


@pytest.mark.slow
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_resumed_run_equals_straight_run(tmp_path, straight, ckpt_format):
    by_iteration, reports, _ = straight[1], straight[2], straight[0]
    assert sorted(by_iteration) == list(range(1, 2 * N + 1)), by_iteration
    (first_out, first_losses, _), (second_out, second_losses, second_reports) = _save_and_resume(
        tmp_path, ckpt_format)
    # The first leg stopped at N after its save; the layer wrote every rank's state.
    assert sorted(first_losses) == list(range(1, N + 1)), first_losses
    saved = tmp_path / "ckpt" / f"iter_{N:07d}" / "sdp4bit"
    assert sorted(p.name for p in saved.iterdir()) == [f"rank_{r:05d}.pt" for r in range(4)]
    state = torch.load(saved / "rank_00000.pt", weights_only=False)["state"]
    assert state["iteration"] == N and state["rng"] and state["main_shards"], state.keys()
    # The second leg started at N + 1 and continued the straight run bit for bit. (Megatron-LM
    # does not reset its loss sums after a run's first iteration, so the line after it shows
    # the mean of both: in the straight run at iteration 2, in the resumed one at N + 2.)
    assert sorted(second_losses) == list(range(N + 1, 2 * N + 1)), second_losses
    assert first_losses == {i: by_iteration[i] for i in range(1, N + 1)}
    assert second_losses[N + 1] == by_iteration[N + 1]
    assert second_losses[N + 2] == pytest.approx((by_iteration[N + 1] + by_iteration[N + 2]) / 2, abs=2e-6)
    assert {i: second_losses[i] for i in range(N + 3, 2 * N + 1)} == \
        {i: by_iteration[i] for i in range(N + 3, 2 * N + 1)}
    for rank in range(4):
        assert second_reports[rank]["iteration"] == 2 * N, second_reports[rank]
        assert second_reports[rank]["sha256"] == reports[rank]["sha256"], rank


@pytest.mark.slow
def test_with_overlapped_weight_gathers_a_resume_equals_a_straight_run_that_saved(tmp_path):
    """--overlap-param-gather: a save forces every weight gather at once, in bucket order,
    where the overlapped ones run first-needed-first in the next forward; with stochastic
    rounding each rank's gathers draw from one stream, so the save itself picks the next
    noise. The checkpoint then holds what a resume needs: N saved + N resumed must equal a
    straight 2N-iteration run that also saved at N, bit for bit."""
    overlap = ["--overlap-param-gather", "--ckpt-format", "torch_dist", "--save-interval", str(N)]
    _, straight_losses, straight_reports = _ok(
        _launch(tmp_path, "straight", 4, overlap + ["--save", str(tmp_path / "straight_ckpt")]))
    ckpt = str(tmp_path / "ckpt")
    _, first_losses, _ = _ok(_launch(tmp_path, "first", 4, overlap + ["--save", ckpt, "--exit-interval", str(N)]))
    _, second_losses, second_reports = _ok(_launch(tmp_path, "second", 4, overlap + ["--load", ckpt]))
    assert sorted(straight_losses) == list(range(1, 2 * N + 1)), straight_losses
    assert first_losses == {i: straight_losses[i] for i in range(1, N + 1)}
    assert second_losses[N + 1] == straight_losses[N + 1]  # the first step after the save
    assert {i: second_losses[i] for i in range(N + 3, 2 * N + 1)} == \
        {i: straight_losses[i] for i in range(N + 3, 2 * N + 1)}
    for rank in range(4):
        assert second_reports[rank]["sha256"] == straight_reports[rank]["sha256"], rank


@pytest.mark.slow
def test_log_lines_install_line_and_summary(straight):
    output, losses, _ = straight
    lines = [line for line in output.splitlines() if " iteration " in line and "lm loss" in line]
    assert len(lines) == 2 * N, lines
    ratios = [float(re.search(r"sdp4bit bytes sent/exact: ([0-9.]+) ", line).group(1)) for line in lines]
    # The weights are quantized from the first step, the gradients from --sdp4bit-grad-start-iter
    # (step N + 1, logged at iteration N + 2) on: fewer bytes again from there.
    assert all(r < 1 for r in ratios) and len(set(ratios[:N + 1])) == 1, ratios
    assert all(r < ratios[0] for r in ratios[N + 1:]), ratios
    for line in lines:
        assert re.search(r"sdp4bit replica checks passed: \d+ \|", line), line
    # --log-interval 1: every step is sampled; the gradient quantizers sample once they run.
    assert all("sdp4bit weight error: " in line for line in lines), lines
    assert not any("sdp4bit grad_intra error: " in line for line in lines[:N + 1]), lines
    assert all("sdp4bit grad_intra error: " in line for line in lines[N + 1:]), lines
    assert [int(re.search(r"replica checks passed: (\d+)", line).group(1)) for line in lines] == \
        list(range(1, 2 * N + 1))
    assert output.count("SDP4Bit installed (megatron-core") == 1, output
    assert "=== SDP4Bit summary (rank 3) ===" in output
    assert re.search(rf"replica checks +{2 * N} passed", output), output


@pytest.mark.slow
def test_resume_on_another_data_parallel_size_is_refused_in_one_line(tmp_path):
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--exit-interval", "1",
            "--ckpt-format", "torch_dist"]
    _ok(_launch(tmp_path, "first", 4, save))
    code, output, losses, _ = _launch(tmp_path, "second", 2, ["--load", str(tmp_path / "ckpt"),
                                                               "--ckpt-format", "torch_dist"])
    assert code != 0 and not losses, output[-3000:]
    refusals = [line for line in output.splitlines() if line.startswith("sdp4bit: ")]
    assert len(refusals) == 1, output[-3000:]
    assert "exact fp32 main shards" in refusals[0] and "resume with the saved sizes" in refusals[0], refusals


pytestmark = needs_loop
