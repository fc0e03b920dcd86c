"""Sampled measures of how much the quantizers change what they send.

Both are relative L2 errors on a slice of at most ``SAMPLE`` elements. They are
computed only on the iterations the caller asks for (``QuantErrorMetrics``: the
last step of every ``interval`` steps; none by default) and kept as device
tensors, so a training step never waits for the device because of them: the
conversion to floats happens when they are read.
"""
from __future__ import annotations

import math
from typing import Dict, Sequence

import torch

from megatron_sdp4bit import quant
from megatron_sdp4bit.config import SDP4BitConfig

SAMPLE = 1 << 16


class QuantErrorMetrics:
    """When to sample, and the latest samples (device tensors until read)."""

    def __init__(self) -> None:
        self.interval = 0
        self._latest: Dict[str, torch.Tensor] = {}

    def set_interval(self, interval: int) -> None:
        """Sample on the last step of every ``interval`` steps; 0 turns sampling off."""
        if not isinstance(interval, int) or interval < 0:
            raise ValueError(f"metrics interval must be an integer >= 0, got {interval!r}")
        self.interval = interval

    def sample_now(self, iteration: int) -> bool:
        """Whether the step that completes ``iteration + 1`` steps is sampled."""
        return self.interval > 0 and (iteration + 1) % self.interval == 0

    def record(self, values: Dict[str, torch.Tensor]) -> None:
        self._latest.update(values)

    def read(self) -> Dict[str, float]:
        """The samples taken since the last read, as floats (this is where the device is
        waited for). A sample is read once: a window whose sampled step was skipped
        (Inf/NaN) reports nothing rather than an earlier window's figure."""
        samples = {name: float(value) for name, value in self._latest.items()}
        self._latest.clear()
        return samples


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||approx - exact|| / ||exact|| as a 0-d tensor on their device: 0 when exact is
    0, NaN when exact holds Inf/NaN (an error of 0 there would hide the bad values).

    No host synchronisation: the zero case is a ``torch.where``, not an ``if``.
    """
    exact = exact.float()
    norm = exact.norm()
    error = (approx.float() - exact).norm()
    zero = norm == 0
    relative = error / torch.where(zero, 1.0, norm)
    return torch.where(zero, 0.0, torch.where(torch.isfinite(norm), relative, math.nan))


def grad_quantization_errors(grad_data: torch.Tensor, config: SDP4BitConfig,
                             levels: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Relative error of the quantizer of each gradient hop that runs, on a slice of
    local gradients.

    ``levels``: the hops the reduce-scatter runs, in order (``comm.Topology.levels``'
    names): ``("intra", "inter")`` across nodes of several ranks each, ``("intra",)``
    on one node, ``("inter",)`` with one rank per node. A hop that does not run has no
    error to report (before, one node reported the 4-bit inter-node hop's too).
    A local estimate (no communication): hop 1 quantizes the (Hadamard-rotated) local
    gradients, hop 2 partial sums in the same rotated domain, whose statistics are
    alike. Returns ``{"grad_<level>": error}`` as device tensors (empty when the buffer
    is smaller than one group, or no hop runs).
    """
    if not levels:
        return {}
    block = config.grad_hadamard_block
    align = config.grad_alignment(tuple(levels))
    n = min(SAMPLE, grad_data.numel()) // align * align
    if n == 0:
        return {}
    x = grad_data.view(-1)[:n].float()
    errors = {}
    for level in levels:
        bits, group = config.grad_hop_format(level)
        # A private generator: sampling must not move the training's RNG streams.
        gen = torch.Generator(device=x.device).manual_seed(config.seed)
        q = quant.hadamard_quantize(x, bits=bits, group_size=group, hadamard_block=block,
                                    rounding=config.rounding, generator=gen)
        approx = quant.dequantize_sum(q, 1, inverse_hadamard_block=block)
        errors[f"grad_{level}"] = relative_error(approx, x)
    return errors
