"""Chunks of 2^31 elements or more: the dequantize kernel writes every element.

The strip path's tail arithmetic cast "elements of the strip before the end" to
int32 unclamped: in a chunk of 2^31 or more elements it wrapped negative and the
strips' stores were silently masked off. A chunk that size needs gigabytes, so
the launch is planned as the API plans it (``triton_ops._plan_dequantize``) on a
small tensor that one program covers, then told that its chunk has 2^31 + 8
elements (TAIL set, as for such a numel): the program's reads and writes stay in
the small buffers, and every element must be written as for the small tensor.

A kernel test file (see test_triton.py's docstring): run in Triton's interpreter
by test_triton.py, and on CUDA by scripts/gpu_check_triton.py.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_sdp4bit.quant import reference as R  # noqa: E402
from triton_cases import (  # noqa: E402
    DEVICE,
    KERNELS_HERE,
    assert_same_values,
    few_large_programs,  # noqa: F401  (an autouse fixture)
    on_cpu,
    received_buffer,
)

if not KERNELS_HERE:
    pytest.skip("kernel tests: run by test_triton.py in Triton's interpreter, or on CUDA",
                allow_module_level=True)

from triton_cases import T  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_chunk_of_2_31_elements_or_more_is_written_whole(bits, dtype):
    q = received_buffer(1, 1024, bits, 128, specials=False)
    out = torch.full((1024,), float("nan"), dtype=dtype, device=DEVICE)
    call = T._plan_dequantize(q, out, 0)
    assert call.kwargs["STRIPS"] and call.grid == (1, 1), "the strip path, one program"
    call.args[3] = 2**31 + 8  # the chunk's numel, as the kernel sees it
    call.kwargs["TAIL"] = True
    call()
    assert_same_values(out, R.dequantize(on_cpu(q), dtype))
