"""Sampled measures of how much the quantizers change what they send.

The errors are relative L2 errors on a slice of at most ``SAMPLE`` elements. The
group shape (``gradient_group_shape``) says whether the gradients' 4-bit groups
carry outliers, the thing TLq-HS's Hadamard rotation is for: the crest factor
max|g| / rms(g) of groups spread over every bucket, and the 4-bit error of those
groups without the rotation (TLq) and with it (TLq-HS), whichever mode runs.
All are computed only on the iterations the caller asks for (``QuantErrorMetrics``:
the last step of every ``interval`` steps; none by default) and kept as device
tensors, so a training step never waits for the device because of them: the
conversion to floats happens when they are read.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

from megatron_sdp4bit import quant
from megatron_sdp4bit.config import SDP4BitConfig

SAMPLE = 1 << 16
GROUP_SAMPLE = 1 << 18
"""Elements of whole 4-bit groups sampled per gradient buffer for the group shape."""
CREST_THRESHOLD = 8.0
"""A group above it has one element carrying about half its energy (8^2 / 128)."""


class QuantErrorMetrics:
    """When to sample, and the latest samples (device tensors until read)."""

    def __init__(self) -> None:
        self.interval = 0
        self._latest: Dict[str, torch.Tensor] = {}
        self._group_shapes: List[Dict[str, torch.Tensor]] = []
        self._group_shapes_at: Optional[int] = None  # the sampled step they are of

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

    def record_group_shape(self, sample: Dict[str, torch.Tensor], iteration: int) -> None:
        """One buffer's ``gradient_group_shape`` at the sampled step ``iteration``; that
        step's buffers add up. A later sampled step replaces what was not read, so a rank
        that never reads keeps one step's device tensors, not every sampled step's."""
        if iteration != self._group_shapes_at:
            self._group_shapes, self._group_shapes_at = [], iteration
        self._group_shapes.append(sample)

    def read_group_shape(self) -> Dict[str, float]:
        """The 4-bit gradient groups of the latest sampled step not yet read, all buffers:
        ``groups`` (how many), the crest factor's ``crest_median`` / ``crest_p99`` /
        ``crest_max`` and ``crest_share_above_8`` (all-zero groups left out), and the
        4-bit relative errors ``error_tlq`` (no rotation) and ``error_tlq_hs``. Empty
        when nothing was sampled."""
        shapes, self._group_shapes = self._group_shapes, []
        if not shapes:
            return {}
        crests = torch.cat([s["crest"].double().cpu() for s in shapes])
        summary = crest_summary(crests, CREST_THRESHOLD)
        out = {"groups": float(summary["groups"])}
        if summary["groups"]:
            out.update({"crest_median": summary["median"], "crest_p99": summary["p99"],
                        "crest_max": summary["max"], "crest_share_above_8": summary["share_above"]})
        norm2 = sum(float(s["norm2"]) for s in shapes)
        for mode in ("tlq", "tlq_hs"):
            error2 = sum(float(s[f"error2_{mode}"]) for s in shapes)
            out[f"error_{mode}"] = math.sqrt(error2 / norm2) if norm2 > 0 else math.nan
        return out


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


def crest_factors(groups: torch.Tensor) -> torch.Tensor:
    """max |g| / rms(g) per row of ``groups``; NaN for an all-zero row (no scale)."""
    groups = groups.to(torch.float64)
    rms = groups.pow(2).mean(dim=1).sqrt()
    peak = groups.abs().amax(dim=1)
    return torch.where(rms > 0, peak / rms, torch.full_like(rms, float("nan")))


def crest_summary(crests: torch.Tensor, threshold: float) -> dict:
    """Median, 99th percentile, max and the share above ``threshold`` of the finite
    crest factors; counts of groups used and of all-zero groups left out."""
    finite = crests[torch.isfinite(crests)].to(torch.float64)
    if finite.numel() == 0:
        return {"groups": 0, "zero_groups": int(crests.numel())}
    return {"groups": int(finite.numel()), "zero_groups": int(crests.numel() - finite.numel()),
            "median": float(finite.median()), "p99": float(torch.quantile(finite, 0.99)),
            "max": float(finite.max()), "share_above": float((finite > threshold).double().mean())}


def spread_groups(grad_data: torch.Tensor, group_size: int, limit: int = GROUP_SAMPLE) -> torch.Tensor:
    """Every s-th whole group of ``grad_data`` (as [groups, group_size]), s the smallest
    stride that keeps at most ``limit`` elements (at least one group): a sample over all
    the buffer's parameters (its first elements are the last layer's alone)."""
    count = grad_data.numel() // group_size
    stride = max(1, -(-count * group_size // max(limit, group_size)))
    return grad_data.view(-1)[:count * group_size].view(count, group_size)[::stride]


def gradient_group_shape(grad_data: torch.Tensor, config: SDP4BitConfig,
                         limit: int = GROUP_SAMPLE) -> Dict[str, torch.Tensor]:
    """Whether a gradient buffer's 4-bit groups carry outliers, as device tensors.

    The groups are the inter-node hop's (``grad_bits_inter`` bits in groups of
    ``grad_group_size_inter``), cut from the buffer's start as the hop cuts a chunk
    and sampled by ``spread_groups`` (at most ``limit`` elements, at least one group):
    ``crest`` (each group's crest factor), and over
    the sample ``norm2`` (sum of g^2) and the squared errors of quantizing it without
    the rotation (``error2_tlq``, ``quant.quantize``) and with it in blocks of
    ``hadamard_block`` (``error2_tlq_hs``), with the config's rounding. Both are
    measured whichever mode the run uses: the pair says what the rotation buys on
    this run's gradients. Local gradients before the reduce (the hop quantizes a
    node's partial sum: the same kind of tensor over fewer samples). Empty when the
    buffer is smaller than one group.
    """
    bits, group = config.grad_hop_format("inter")
    groups = spread_groups(grad_data, group, limit)
    if groups.shape[0] == 0:
        return {}
    x = groups.float().contiguous().view(-1)
    # A private generator: sampling must not move the training's RNG streams.
    gen = torch.Generator(device=x.device).manual_seed(config.seed)
    plain = quant.dequantize(quant.quantize(x, bits, group, config.rounding, gen))
    rotated = quant.dequantize_sum(
        quant.hadamard_quantize(x, bits, group, config.hadamard_block, config.rounding, gen), 1,
        config.hadamard_block)
    return {"crest": crest_factors(groups), "norm2": x.double().pow(2).sum(),
            "error2_tlq": (plain - x).double().pow(2).sum(),
            "error2_tlq_hs": (rotated - x).double().pow(2).sum()}
