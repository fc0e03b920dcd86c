"""What the Triton kernel tests share: where they run, inputs, comparisons.

Where the kernels run (see test_triton.py's docstring): on CUDA tensors with
``SDP4BIT_TRITON_TEST_DEVICE=cuda``, on CPU tensors in Triton's interpreter when
this process started with TRITON_INTERPRET=1; in a plain CPU process the
kernel tests are not run here (test_triton.py re-runs them in an interpreter).
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_sdp4bit.quant import reference as R
from megatron_sdp4bit.quant.packing import unpack_codes
from megatron_sdp4bit.quant.types import QuantizedTensor, qmax

DEVICE = os.environ.get("SDP4BIT_TRITON_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("SDP4BIT_TRITON_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)
# Kernel tests run in this process on CUDA, or on CPU when this process started
# with TRITON_INTERPRET=1 (then triton was imported in interpreter mode).
KERNELS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



if KERNELS_HERE:
    from megatron_sdp4bit.quant import triton_ops as T
    from megatron_sdp4bit.quant.triton_kernels import launch_plan

    if T.INTERPRETED != (DEVICE == "cpu"):
        raise RuntimeError(
            "triton_ops was imported before TRITON_INTERPRET was set as this run needs; "
            "run the kernel test files on their own"
        )


@pytest.fixture(autouse=True)
def few_large_programs():
    """The interpreter pays per program: run each small input in one or two."""
    if DEVICE == "cpu" and KERNELS_HERE:
        with launch_plan.tuning(tile_elements=1 << 16):
            yield
    else:
        yield


# --- inputs and comparisons ----------------------------------------------------------

def awkward_input(numel: int, group: int, bits: int, dtype=torch.float32, seed: int = 0,
                  specials: bool = True):
    """Random groups spanning 1e-3..1e3, plus (``specials`` and enough groups) groups
    of exact rounding ties, NaN, +-Inf, zeros, subnormals, and near fp32 max."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-numel // group)
    x = torch.randn(groups, group, generator=gen)
    x *= torch.logspace(-3, 3, groups).unsqueeze(1)
    levels = qmax(bits)
    ties = torch.arange(-2 * levels, 2 * levels + 1, dtype=torch.float32) * 0.5  # v = k/2, scale 1
    special_groups = [
        ties.repeat(-(-group // ties.numel()))[:group],
        torch.full((group,), float("nan")),
        torch.full((group,), float("inf")),
        torch.zeros(group),
        # Subnormal absmax: 1/scale overflows to Inf, and 0 * Inf gives code 0.
        torch.cat([torch.zeros(1), torch.full((group - 1,), 1e-39)]),
        torch.linspace(-1e-40, 1e-40, group),
        torch.full((group,), -3e38),
    ]
    for g, values in enumerate(special_groups[: max(0, groups - 2)] if specials else []):
        x[g + 1] = values
        if g in (1, 2):  # one NaN / Inf among finite values
            x[g + 1] = torch.randn(group, generator=gen)
            x[g + 1, group // 2] = values[0] * (-1 if g == 2 else 1)
    x = x.reshape(-1)[:numel].to(dtype)
    return x.to(DEVICE)


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor):
    """Same dtype and shape, NaN at the same places, identical values elsewhere.

    Floats compare with ==, which is bit equality except that -0 == +0: the
    reference's absmax, max(amax, -amin), returns -0 for some all-zero groups.
    """
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), "NaN in different places"
    mismatch = (actual.masked_fill(nan, 0) != expected.masked_fill(nan, 0)).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} values differ, first at {mismatch[0].tolist()}: "
        f"{actual[tuple(mismatch[0])]} != {expected[tuple(mismatch[0])]}"
    )


def assert_same_quantized(actual: QuantizedTensor, expected: QuantizedTensor):
    assert (actual.bits, actual.group_size, actual.numel, actual.dtype) == (
        expected.bits, expected.group_size, expected.numel, expected.dtype)
    assert actual.codes.device.type == DEVICE
    assert actual.codes.dtype == expected.codes.dtype
    assert torch.equal(actual.codes.cpu(), expected.codes), "codes differ"
    assert_same_values(actual.scales, expected.scales)


def on_cpu(q: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(q.codes.cpu(), q.scales.cpu(), q.bits, q.group_size, q.numel, q.dtype)


def on_device(q: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(q.codes.to(DEVICE), q.scales.to(DEVICE), q.bits, q.group_size,
                           q.numel, q.dtype)


def received_buffer(chunks: int, chunk: int, bits: int, group: int, seed: int = 0,
                    specials: bool = True):
    """k quantized chunks as an all-to-all receive buffer (reference-made, on DEVICE)."""
    x = awkward_input(chunks * chunk, group, bits, seed=seed, specials=specials)
    q = R.quantize(x.cpu(), bits, group, "nearest")
    return on_device(q)




def codes_of(q: QuantizedTensor) -> torch.Tensor:
    """q's codes as fp32 (all chunks, padding included)."""
    return unpack_codes(q.codes.reshape(-1).cpu(), q.bits, q.padded_numel).to(torch.float32)
