"""What only a GPU can show, as pytest tests: ``pytest -m gpu`` on a machine with CUDA.

The same checks as ``scripts/gpu_check.sh``'s steps, through the same package code
(each skipped without a CUDA device, so the CPU suite only collects them):

- every kernel variant compiles for this GPU's architecture with no instruction that
  would break bit equality (``quant/triton_kernels/compile_check.py``);
- CUDA tensors go to the Triton backend, and the gradient and weight paths at scale are
  bit-identical to the CPU reference (``diagnostics/kernel_identity.py``);
- the quantized collectives on 4 gloo ranks sharing the GPU as 2 emulated nodes x 2,
  against the CPU reference and the exact sums (``diagnostics/device_collectives.py``).

- the kernels' own tests (tests/quant: the files ``scripts/gpu_check_triton.py`` names)
  on CUDA tensors (``SDP4BIT_TRITON_TEST_DEVICE=cuda``, which those files read when
  they are imported, hence a pytest of their own).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _arch() -> int:
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def test_every_kernel_variant_compiles_exactly_for_this_gpu():
    result = subprocess.run(
        [sys.executable, "-m", "megatron_sdp4bit.quant.triton_kernels.compile_check",
         "--arch", str(_arch())], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TRITON_INTERPRET="0"))  # JIT functions, not the interpreter
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_kernel_tests_pass_on_cuda_tensors():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check_triton_files", os.path.join(ROOT, "scripts", "gpu_check_triton.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # its TEST_FILES: one list for both
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
         *script.TEST_FILES], cwd=ROOT, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, SDP4BIT_TRITON_TEST_DEVICE="cuda", TRITON_INTERPRET="0"))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_cuda_tensors_go_to_the_triton_kernels():
    from megatron_sdp4bit import quant

    assert quant.backend_for(torch.empty(1, device="cuda")).__name__.endswith("triton_ops")


def test_both_paths_at_scale_are_bit_identical_to_the_reference():
    from megatron_sdp4bit.diagnostics.kernel_identity import large_path_differences

    assert large_path_differences("cuda", (1 << 23) + 128 * 3) == []


@pytest.mark.parametrize("runner, shard", [("layer", 1 << 18), ("stream", 1 << 16)])
def test_the_collectives_on_four_ranks_sharing_the_gpu_hold(tmp_path, runner, shard):
    """The layer's gloo runner (a worker thread with a side stream), and the one it takes on
    NCCL (a side stream on the caller), whose stream order gloo's CUDA staging follows."""
    out = tmp_path / "cases.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "megatron_sdp4bit.diagnostics.device_collectives", "--device", "cuda",
           "--ranks-per-node", "2", "--backend", "gloo", "--levels", "2", "--runner", runner,
           "--shard", str(shard), "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    failed = [case for case in json.loads(out.read_text())["cases"] if not case["passed"]]
    assert not failed, failed[:3]


def test_the_runners_side_stream_outranks_the_compute_stream():
    from megatron_sdp4bit.comm.runner import StreamRunner

    runner = StreamRunner(torch.device("cuda", torch.cuda.current_device()))
    try:
        assert runner.stream.priority < torch.cuda.current_stream().priority
    finally:
        runner.close()
