"""CPU stand-ins for what megatron asks of CUDA: ``torch.cuda``'s functions, and a device
mode under which code that names CUDA gets CPU tensors (``core.py`` says where each
is used and why)."""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch.overrides import TorchFunctionMode

from megatron_sdp4bit.patching import Patches


class CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream`` stand-in: accepts the CUDA signature; CPU work is in order."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        super().__init__()

    def synchronize(self) -> None:
        """Nothing to wait for: CPU kernels finish before the call returns."""

    def query(self) -> bool:
        """Always complete."""
        return True


class CpuEvent(torch.cpu.Event):
    """``torch.cuda.Event`` stand-in: accepts the CUDA signature; always complete."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **kwargs) -> None:
        super().__init__()


def _cpu_default_stream(device=None) -> torch.cpu.Stream:
    return torch.cpu.current_stream()


TORCH_CUDA_TWINS = {
    "current_device": torch.cpu.current_device,
    "synchronize": torch.cpu.synchronize,
    "Stream": CpuStream,
    "Event": CpuEvent,
    "stream": torch.cpu.stream,
    "current_stream": torch.cpu.current_stream,
    "default_stream": _cpu_default_stream,
}
"""``torch.cuda.<name>`` -> its CPU twin, process-wide while the backend is on."""


def torch_cuda_as(twins: Dict[str, Any]) -> Patches:
    """``torch.cuda.<name>`` set to ``twins[name]``; the ``Patches`` returned, used as a
    ``with`` block around one call, puts the previous values back after it."""
    during_call = Patches("CPU backend")
    for name, twin in twins.items():
        during_call.set(torch.cuda, name, twin)
    return during_call


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class CudaNamesOnCpu(TorchFunctionMode):
    """Lets megatron code that names CUDA run on CPU tensors, while it is active.

    * a CUDA ``device=`` keyword (``'cuda'``, ``'cuda:0'``, ``torch.device('cuda')``)
      becomes ``'cpu'``;
    * ``Tensor.cuda(...)`` returns the tensor itself (it already is on the CPU);
    * with ``type_names=True`` only: ``Tensor.type()`` without arguments reports a CPU
      tensor under its CUDA name (``torch.cuda.FloatTensor``), because megatron decides
      how to shard a param by comparing that string.
    """

    def __init__(self, type_names: bool = False):
        super().__init__()
        self.type_names = type_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _cuda_type_name(tensor: torch.Tensor) -> str:
    name = torch.Tensor.type(tensor)
    if tensor.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
        return "torch.cuda." + name[len("torch."):]
    return name
