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
- a missing or damaged ``sdp4bit/rank_N.pt`` (rank 0's too) stops every rank with one line
  naming it; a checkpoint saved without ``--sdp4bit`` resumes with one line saying so; a
  resume without ``--sdp4bit`` of one saved with it says it leaves that state unused;
- ``torch_dist`` saves asynchronously through megatron's persistent checkpoint worker;
- the iteration lines carry the bytes sent vs exact, the replica checks and the sampled
  quantization errors; rank 0 prints the install line once; the last rank prints the
  summary.

``resume_state`` (which saved file each rank takes, when another size is refused, and the
one outcome of all ranks) is checked on files the test writes, without megatron
(``test_megatron_lm_checkpoint_files.py``).

Needs ``megatron.training`` (the megatron-core 0.19.2 wheel ships it; 0.16.1's does not).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
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


def _launch(tmp_path, name: str, ranks: int, extra_args, sdp4bit=True):
    """One job: (exit code, output, Megatron-LM's losses by iteration, reports by rank);
    ``sdp4bit=False``: without any --sdp4bit flag (a stock run)."""
    folder = tmp_path / name
    folder.mkdir()
    script = tmp_path / "pretrain_tiny_gpt.py"
    script.write_text(LOOP.SCRIPT)
    env = dict(os.environ, SDP4BIT_CPU="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               CUDA_DEVICE_MAX_CONNECTIONS="1", REPORT_DIR=str(folder),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--monitor-interval", "0.1", "-m", "megatron_sdp4bit.launch", str(script), *FP32_ARGS, *extra_args,
           *(SDP4BIT_ARGS if sdp4bit else [])]
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


ASYNC_SAVE = ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]


def _save_and_resume(tmp_path, ckpt_format: str):
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", str(N), "--exit-interval", str(N),
            "--ckpt-format", ckpt_format]
    if ckpt_format == "torch_dist":  # asynchronously, through megatron's persistent worker
        save += ASYNC_SAVE
    first = _ok(_launch(tmp_path, "first", 4, save))
    second = _ok(_launch(tmp_path, "second", 4, ["--load", str(tmp_path / "ckpt"), "--ckpt-format", ckpt_format]))
    return first, second


@pytest.mark.slow
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_resumed_run_equals_straight_run(tmp_path, straight, ckpt_format):
    """``torch_dist`` saves asynchronously (--async-save --use-persistent-ckpt-worker: before,
    the CPU mode's first save waited for a worker that had died, for good)."""
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
    assert not any("sdp4bit grad groups crest p99: " in line for line in lines[:N + 1]), lines
    assert all("sdp4bit grad groups crest p99: " in line for line in lines[N + 1:]), lines
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


@pytest.fixture(scope="module")
def one_save(tmp_path_factory):
    """A checkpoint of iteration 1 saved by 2 ranks with --sdp4bit (fp32: exact main shards)."""
    tmp_path = tmp_path_factory.mktemp("one_save")
    _ok(_launch(tmp_path, "save", 2, ["--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                                      "--exit-interval", "1", "--ckpt-format", "torch_dist"]))
    return tmp_path / "ckpt"


def _load(tmp_path, ckpt, sdp4bit=True):
    return _launch(tmp_path, "load", 2, ["--load", str(ckpt), "--ckpt-format", "torch_dist"], sdp4bit=sdp4bit)


def _damaged_copy(tmp_path, one_save, rank, content):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(one_save, ckpt)
    path = ckpt / "iter_0000001" / "sdp4bit" / f"rank_{rank:05d}.pt"
    if content is None:
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:content])  # a save cut short
    return ckpt, path


@pytest.mark.slow
@pytest.mark.parametrize("rank, content, how", [(1, None, "is missing"), (0, None, "is missing"),
                                                (1, 100, "is unreadable")])
def test_a_missing_or_damaged_rank_file_stops_every_rank_with_one_line(tmp_path, one_save, rank, content, how):
    """Before: rank 1's file missing or cut short, rank 1 stopped alone and the others died in
    gloo after a 30 s stall, no line; rank 0's file missing read as "saved without --sdp4bit"
    and every rank dropped its intact state (exact fp32 main shards, rounding streams) and
    trained on."""
    ckpt, path = _damaged_copy(tmp_path, one_save, rank, content)
    code, output, losses, _ = _load(tmp_path, ckpt)
    assert code != 0 and not losses, output[-4000:]
    ours = [line for line in output.splitlines() if line.startswith("sdp4bit: ")]
    assert len(ours) == 1 and ours[0].startswith(f"sdp4bit: {path} {how}"), output[-4000:]
    assert "load an earlier iteration (--ckpt-step)" in ours[0], ours
    assert "exitcode  : 2" in output and "Connection closed by peer" not in output, output[-4000:]
    assert output.count("Traceback") <= 1, output[-4000:]  # torchrun's own report only


@pytest.mark.slow
def test_a_checkpoint_saved_without_sdp4bit_resumes_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    _ok(_launch(tmp_path, "stock", 2, ["--save", str(ckpt), "--save-interval", "1", "--exit-interval", "1",
                                       "--ckpt-format", "torch_dist"], sdp4bit=False))
    output, losses, reports = _ok(_load(tmp_path, ckpt))
    said = [line for line in output.splitlines() if line.startswith("sdp4bit: ")]
    assert said == [f"sdp4bit: {ckpt / 'iter_0000001'} holds no SDP4Bit state (saved without --sdp4bit): the "
                    "layer continues from step 1 with fresh rounding streams"], said
    assert sorted(losses) == list(range(2, 2 * N + 1)) and reports[0]["iteration"] == 2 * N


@pytest.mark.slow
def test_a_resume_without_sdp4bit_says_it_leaves_the_layers_state_unused(tmp_path, one_save):
    """Before: the exact fp32 main shards and rounding streams were dropped without a word."""
    output, losses, _ = _ok(_load(tmp_path, one_save, sdp4bit=False))
    said = [line for line in output.splitlines() if line.startswith("sdp4bit: ")]
    assert len(said) == 1 and said[0].startswith(f"sdp4bit: {one_save / 'iter_0000001'} was saved with "
                                                 "--sdp4bit; this run has no --sdp4bit"), said
    assert sorted(losses) == list(range(2, 2 * N + 1))
