"""stage_chunk_rows: a chunk's slice of every shard, in send order, zero-padded.

Runs on the CPU in `make test`, and on CUDA tensors from scripts/gpu_check.sh
(SDP4BIT_TRITON_TEST_DEVICE=cuda, the device knob of the kernel tests): the
multi-rank reduce-scatter cannot run on one GPU, so its staging is checked alone.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_sdp4bit.comm.gradients import stage_chunk_rows
from megatron_sdp4bit.comm.layout import chunk_plan

DEVICE = os.environ.get("SDP4BIT_TRITON_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("SDP4BIT_TRITON_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)


def _expected(rows, chunk, send_order):
    """The plain definition: each shard's slice in send order, padded with zeros."""
    out = torch.zeros(len(send_order), chunk.padded, dtype=rows.dtype)
    for slot, source in enumerate(send_order):
        out[slot, : chunk.valid] = rows[source, chunk.start: chunk.start + chunk.valid].cpu()
    return out.view(-1)


@pytest.mark.parametrize("send_order", [(0, 1, 2, 3), (0, 2, 1, 3)])
@pytest.mark.parametrize("shard, align, chunks", [(1024, 128, 1), (1024, 128, 3), (1000, 128, 3),
                                                  (100, 128, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_rows_are_each_shards_slice_in_send_order_zero_padded(send_order, shard, align,
                                                                     chunks, dtype):
    rows = torch.randn(len(send_order), shard, generator=torch.Generator().manual_seed(3))
    rows = rows.to(dtype=dtype, device=DEVICE)
    identity = send_order == tuple(range(len(send_order)))
    index = None if identity else torch.tensor(send_order, dtype=torch.long, device=DEVICE)
    for chunk in chunk_plan(shard, align, chunks):
        staged = stage_chunk_rows(rows, chunk, send_order, index)
        assert staged.device == rows.device and staged.dtype == dtype
        assert torch.equal(staged.cpu(), _expected(rows, chunk, send_order)), chunk
