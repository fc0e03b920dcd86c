"""Reused buffers: a collective with a ``Workspace`` allocates on its first call only,
and reuse changes no bit of any result.

The reuse rules are the risky part (a buffer handed on before its transfer or its
reader is done corrupts data silently), so every schedule that takes turns on the
slots runs here: several pipeline chunks (chunk i + 2 reuses chunk i's slot) on one
level and on two, sync and async, and a synchronous weight gather in several slices.
Each result must equal the same call without a workspace, bit for bit (nearest
rounding), call after call; allocations inside the collectives are counted.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from comm_worlds import battery
from megatron_sdp4bit.comm import quantized_all_gather_weights, quantized_reduce_scatter, weights
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig

ALLOCATORS = ("empty", "zeros", "empty_like", "zeros_like")


COMM_DIR = os.path.join("megatron_sdp4bit", "comm") + os.sep


class AllocationCounter:
    """Counts, while active, the tensors ``comm`` itself allocates (torch's factories
    called from a file of megatron_sdp4bit/comm/). What the quantization ops allocate
    inside is theirs: the Triton ops write into ``out=`` and allocate nothing, the torch
    reference (CPU) works in scratch of its own."""

    def __init__(self):
        self.count, self.saved = 0, {}

    def __enter__(self):
        for name in ALLOCATORS:
            original = self.saved[name] = getattr(torch, name)

            def counted(*args, __original=original, **kwargs):
                if COMM_DIR in sys._getframe(1).f_code.co_filename:
                    self.count += 1
                return __original(*args, **kwargs)
            setattr(torch, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch, name, original)


def _grads(rank, world, rpn, chunks, async_op, space, seed):
    config = SDP4BitConfig(ranks_per_node=rpn, pipeline_chunks=chunks, rounding="nearest")
    x = torch.randn(world * 3000, generator=torch.Generator().manual_seed(seed * 10 + rank))
    out = torch.empty(3000)
    handle = quantized_reduce_scatter(out, x, config=config, async_op=async_op, workspace=space)
    if handle is not None:
        handle.wait()
    return out


def _weights(rank, world, async_op, space, seed):
    config = SDP4BitConfig(rounding="nearest")
    shard = 5000
    model = torch.randn(world * shard, generator=torch.Generator().manual_seed(seed)).bfloat16()
    own = model[rank * shard:(rank + 1) * shard]
    main = own.float() + 0.01 * torch.randn(shard, generator=torch.Generator().manual_seed(seed + rank))
    handle = quantized_all_gather_weights(model, main, config=config, async_op=async_op,
                                          workspace=space)
    if handle is not None:
        handle.wait()
    return model


@battery.case(4)
def reuse(rank, world):
    """Each schedule with and without a workspace, three calls each: same bits, and how
    many tensors comm allocated in each call with the workspace."""
    results = {}
    for rpn in (1, 2):  # one level (4 nodes x 1) and two (2 x 2)
        for chunks, async_op in ((4, False), (4, True), (1, True)):
            space = Workspace()
            same, allocations = [], []
            for seed in range(3):
                fresh = _grads(rank, world, rpn, chunks, async_op, None, seed)
                with AllocationCounter() as counter:
                    reused = _grads(rank, world, rpn, chunks, async_op, space, seed)
                same.append(torch.equal(fresh, reused))
                allocations.append(counter.count)
            results[f"grads rpn={rpn} chunks={chunks} async={async_op}"] = (same, allocations)
    caps = weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS
    weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS = world * 2048, 2048  # 3 slices
    try:
        for async_op in (False, True):
            space = Workspace()
            same, allocations = [], []
            for seed in range(3):
                fresh = _weights(rank, world, async_op, None, seed)
                with AllocationCounter() as counter:
                    reused = _weights(rank, world, async_op, space, seed)
                same.append(torch.equal(fresh, reused))
                allocations.append(counter.count)
            results[f"weights async={async_op}"] = (same, allocations)
    finally:
        weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS = caps
    dist.barrier()
    return results


def test_reused_buffers_change_no_bit_and_are_allocated_once():
    for rank_results in battery.results(reuse, 4):
        for case, (same, allocations) in rank_results.items():
            assert same == [True, True, True], f"{case}: a reused buffer changed the result"
            # The first call fills the workspace; the later ones allocate no send or
            # receive buffer (what is left is the shard's unaligned end: one sum).
            assert allocations[0] > allocations[1] == allocations[2], f"{case}: {allocations}"
            assert allocations[1] <= 1, f"{case}: {allocations}"


# --- plans: what a call works out once, kept with the buffers ---------------------------------

def test_a_plan_is_kept_per_input_and_key_and_built_once():
    space, built = Workspace(), []
    x, y = torch.zeros(4), torch.zeros(4)

    def build(tag):
        built.append(tag)
        return tag

    assert space.plan(x, ("a",), lambda: build("x-a")) == "x-a"
    assert space.plan(x, ("a",), lambda: build("again")) == "x-a"  # kept: not built again
    assert space.plan(x, ("b",), lambda: build("x-b")) == "x-b"  # another key
    assert space.plan(y, ("a",), lambda: build("y-a")) == "y-a"  # another input
    assert built == ["x-a", "x-b", "y-a"]


def test_a_moved_buffer_drops_every_plan():
    """A plan holds views of the buffers: a larger request replaces a buffer, and a plan
    still pointing into the old one would write where nobody reads."""
    space, built = Workspace(), []
    x = torch.zeros(4)
    space.buffer("b", 16, "cpu")
    space.plan(x, ("a",), lambda: built.append(1) or 1)
    space.buffer("b", 8, "cpu")  # fits: nothing moves, the plan stays
    space.plan(x, ("a",), lambda: built.append(2) or 2)
    space.buffer("b", 32, "cpu")  # moves
    assert space.plan(x, ("a",), lambda: built.append(3) or 3) == 3
    assert built == [1, 3]


def test_a_plan_goes_with_its_input():
    """Plans hold views of their input's storage: an input the caller dropped must not be
    kept alive by the workspace (a caller passing new tensors every call would leak)."""
    import gc
    import weakref

    space = Workspace()
    x = torch.zeros(1 << 16)
    storage = weakref.ref(x.untyped_storage())
    space.plan(x, ("a",), lambda: x.detach().view(2, -1))  # a view, as plans hold
    del x
    gc.collect()
    assert storage() is None and not space._plans
