"""The warm-up compiles the variants of shards at their ranks' offsets, unaligned ones too.

Triton specialises on a pointer's 16-byte alignment. megatron pads a bucket to a
multiple of lcm(DP, 128) elements, so with DP 128 a shard can have any length,
and this rank's shard of a bf16 bucket (the reduce-scatter's output, the qWD
difference's model shard) then starts off a 16-byte boundary: a warm-up on
aligned tensors left those ranks a variant to compile inside step 1.

One process emulates rank r of DP 128 (8 ranks a node, 16 nodes): the collectives
run on a bf16 bucket with torch.distributed's calls and the hops' transfers
replaced, inside ``launch_record.recording()``, which yields each launch's
Triton cache key (sm_90) without running it. The keys of the warm-up of the
specs ``comm.kernel_specs`` gives for that rank must be exactly the real calls'.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("recording needs the compiled kernels (not the interpreter)", allow_module_level=True)

from megatron_sdp4bit import comm, quant  # noqa: E402
from megatron_sdp4bit.comm import gather_hops, gradients, weights  # noqa: E402
from megatron_sdp4bit.comm.kernel_specs import (  # noqa: E402
    alignment_offset, all_gather_specs, reduce_scatter_specs)
from megatron_sdp4bit.comm.topology import Level  # noqa: E402
from megatron_sdp4bit.config import preset  # noqa: E402
from megatron_sdp4bit.quant import warmup  # noqa: E402
from megatron_sdp4bit.quant.triton_kernels.launch_record import recording  # noqa: E402

DP, PER_NODE = 128, 8
SHARD = 2 * 4096 + 5  # a bucket padded to a multiple of lcm(128, 128): any shard length
CONFIG = preset("sdp4bit", ranks_per_node=PER_NODE, pipeline_chunks=3)  # two whole chunks written in place
LEVELS = (Level("intra", None, PER_NODE), Level("inter", None, DP // PER_NODE))
DONE = SimpleNamespace(wait=lambda: None)


@pytest.fixture
def rank_of_dp_128(monkeypatch):
    """Be group rank r (set ``rank.value``) of DP 128; transfers do nothing, kernels record."""
    from megatron_sdp4bit.quant import triton_ops

    rank = SimpleNamespace(value=0)
    order = torch.arange(DP).view(PER_NODE, -1).t().reshape(-1)  # a two-level send order
    topology = SimpleNamespace(levels=LEVELS, dp_size=DP, global_rank=0,
                               send_order_index=lambda device: order, is_two_level=True,
                               num_nodes=DP // PER_NODE, ranks_per_node=PER_NODE, local_rank=0,
                               intra_group=None, inter_group=None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: DP)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank.value)
    for module in (gradients, weights):
        monkeypatch.setattr(module, "get_topology", lambda group, ranks_per_node: topology)
    for module in (gradients, weights):
        monkeypatch.setattr(module, "peer_split", lambda group, ranks_per_node: (7, 120))
    monkeypatch.setattr(gradients, "all_to_all_equal", lambda output, input, group, async_op=True: DONE)
    for module in (weights, gather_hops):
        monkeypatch.setattr(module, "all_gather_flat", lambda output, input, group, async_op: DONE)
    monkeypatch.setattr(quant, "backend_for", lambda t: triton_ops)
    return rank


def _keys(run) -> set:
    with recording() as launches:
        run()
    return {launch.key for launch in launches}


def _bucket(dtype):
    """A bucket's grads and params, each at the start of its own (aligned) buffer."""
    return torch.zeros(DP * SHARD, dtype=dtype), torch.zeros(DP * SHARD, dtype=dtype)


def _real_calls(rank: int, grads, params) -> None:
    generator = torch.Generator().manual_seed(0)
    comm.quantized_reduce_scatter(grads[rank * SHARD:(rank + 1) * SHARD], grads,
                                  op=torch.distributed.ReduceOp.AVG, group=object(), config=CONFIG,
                                  generator=generator)
    comm.quantized_all_gather_weights(params, torch.zeros(SHARD), group=object(), config=CONFIG,
                                      generator=generator)


def _specs(rank: int, grads, params, offsets: bool = True):
    levels = [(level.name, level.size) for level in LEVELS]
    if not offsets:  # the warm-up before: every tensor aligned
        return (reduce_scatter_specs(SHARD, grads.dtype, levels, CONFIG, average=True, ordered=True)
                + all_gather_specs(SHARD, DP, params.dtype, CONFIG))
    return (reduce_scatter_specs(SHARD, grads.dtype, levels, CONFIG, average=True, ordered=True,
                                 input_offset=alignment_offset(grads),
                                 output_offset=alignment_offset(grads, rank * SHARD))
            + all_gather_specs(SHARD, DP, params.dtype, CONFIG, rank=rank,
                               buffer_offset=alignment_offset(params)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_rank_warms_up_exactly_the_variants_its_calls_use(rank_of_dp_128, dtype):
    grads, params = _bucket(dtype)
    for rank in (0, 1, 2, 127):  # shards at 0, 10, 20, 1270 bytes past a 16-byte boundary (bf16)
        rank_of_dp_128.value = rank
        real = _keys(lambda: _real_calls(rank, grads, params))
        warmed = _keys(lambda: [warmup.run_spec(s, "cpu") for s in dict.fromkeys(_specs(rank, grads, params))])
        assert len(real) >= 6 and warmed == real, f"rank {rank}: {len(real - warmed)} variants left to step 1"


def test_unaligned_shards_are_other_variants(rank_of_dp_128):
    """What the test above guards: rank 1's bf16 calls are not the aligned warm-up's."""
    grads, params = _bucket(torch.bfloat16)
    rank_of_dp_128.value = 1
    aligned = _keys(lambda: [warmup.run_spec(s, "cpu") for s in _specs(1, grads, params, offsets=False)])
    assert not _keys(lambda: _real_calls(1, grads, params)) <= aligned
    assert alignment_offset(grads, SHARD) == 5 and alignment_offset(params[3:]) == 3


def test_a_negative_offset_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="KernelSpec.offset=-1"):
        warmup.KernelSpec("dequantize_sum", 4096, 4, 128, chunks=2, offset=-1)
