"""The layer adds no host-device synchronisation to a training step, and no
quantization work at all with one data-parallel rank.

Host syncs are counted by wrapping the tensor methods that read a device value
on the host (``item``, ``tolist``, ``cpu``, ``__float__``, ``__int__``,
``__bool__``) and the factories that build a tensor from Python data
(``torch.tensor``, ``torch.as_tensor``: on a GPU a blocking host-to-device copy),
and attributing each call to the nearest caller outside torch:
calls from ``megatron_sdp4bit/megatron`` or ``megatron_sdp4bit/comm`` (the code on
a GPU step's path) fail the test. megatron's own syncs (grad norm, loss) and the
quant package's torch reference (CPU only: CUDA tensors go to the Triton kernels)
are not the layer's, nor is the CPU backend (``cpu_backend/``), which only exists to run
megatron on a machine without a GPU.
"""
from __future__ import annotations

import os
import sys

from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.patching import Patches

SYNC_METHODS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")
FROM_PYTHON = ("tensor", "as_tensor")
LAYER_DIRS = (os.path.join("megatron_sdp4bit", "megatron") + os.sep,
              os.path.join("megatron_sdp4bit", "comm") + os.sep)
SDP = preset("sdp4bit", ranks_per_node=2)
SPECS = {
    "bf16": TinyGPTSpec(dtype="bf16"),
    "fp32-overlap": TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True, overlap_param_gather=True,
                                bucket_size=4000),
}


class SyncCounter:
    """Counts host reads of tensors by the file that asked for them, while active."""

    def __init__(self):
        import torch

        from megatron_sdp4bit import cpu_backend
        from megatron_sdp4bit.megatron import consistency

        # Looked through, to the code that asked: torch itself, the CPU backend's
        # wrappers (a test-environment shim, not on a GPU's path) and the weight
        # digest (which the harness, not the step, calls).
        self.transparent = (os.path.dirname(torch.__file__) + os.sep,
                            os.path.dirname(cpu_backend.__file__) + os.sep, consistency.__file__)
        self.calls = []
        self.active = False
        self.patches = Patches("SyncCounter")

    def _caller(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(self.transparent):
            frame = frame.f_back
        return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"

    def _counting(self, label: str, original):
        def counted(*args, **kwargs):
            if self.active:
                self.calls.append((label, self._caller()))
            return original(*args, **kwargs)
        return counted

    def install(self):
        import torch

        for name in SYNC_METHODS:
            self.patches.set(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        for name in FROM_PYTHON:
            self.patches.set(torch, name, self._counting(f"torch.{name}", getattr(torch, name)))

    def uninstall(self):
        self.patches.restore()

    def layer_calls(self):
        return [(name, where) for name, where in self.calls if any(d in where for d in LAYER_DIRS)]


def _count_syncs(rank, world_size, specs, metrics_interval):
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit import comm
    from megatron_sdp4bit.megatron import patch

    results = {}
    for name, spec in specs.items():
        patch.uninstall()
        comm.reset_generators()
        patch.install(SDP)
        patch.set_metrics_interval(metrics_interval)
        trainer = TinyGPTTrainer(spec)
        trainer.train_steps(2)  # first steps: lazily built buffers and caches
        counter = SyncCounter()
        counter.install()
        counter.active = True
        try:
            # The harness hashes weights on the host after each step; that is the
            # test's own reading, not the layer's.
            trainer.train_steps(4)
        finally:
            counter.active = False
            counter.uninstall()
        results[name] = {"layer": counter.layer_calls(), "errors": patch.quantization_errors()}
        patch.uninstall()
    return results


def test_step_has_no_host_sync_from_the_layer_with_metrics_off_or_on():
    per_rank = spawn_ranks(_count_syncs, 4, SPECS, 0, timeout_s=600)
    for rank in per_rank:
        for name, result in rank.items():
            assert result["layer"] == [], f"{name}: host syncs in the layer: {result['layer'][:5]}"
            assert result["errors"] == {}, "metrics off: nothing is sampled"
    sampled = spawn_ranks(_count_syncs, 4, {"bf16": SPECS["bf16"]}, 3, timeout_s=600)
    for rank in sampled:
        result = rank["bf16"]
        # Sampled values stay on the device during the steps ...
        assert result["layer"] == [], f"host syncs in the layer: {result['layer'][:5]}"
        # ... and become floats when read.
        assert set(result["errors"]) == {"weight", "grad_intra", "grad_inter"}
        assert all(isinstance(v, float) and 0 < v < 1 for v in result["errors"].values())


def _one_rank(rank, world_size):
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit import comm, quant
    from megatron_sdp4bit.megatron import patch

    spec = TinyGPTSpec(dtype="bf16")
    stock = [r.weights_sha256 for r in TinyGPTTrainer(spec).train_steps(4)]
    calls = []

    def forbid(name, original):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return wrapper

    with Patches("test") as counters:
        for module, name in ((comm, "quantized_reduce_scatter"), (comm, "quantized_all_gather_weights"),
                             (quant, "backend_for")):  # every quant op dispatches through it
            counters.set(module, name, forbid(name, getattr(module, name)))
        try:
            comm.reset_generators()
            patch.install(preset("sdp4bit", ranks_per_node=1))
            patch.set_metrics_interval(1)
            patched = [r.weights_sha256 for r in TinyGPTTrainer(spec).train_steps(4)]
        finally:
            patch.uninstall()
    return stock, patched, calls


def test_one_rank_adds_no_quantization_work():
    [(stock, patched, calls)] = spawn_ranks(_one_rank, 1, timeout_s=300)
    assert calls == []
    assert patched == stock  # megatron's own copy: bit-identical to stock
