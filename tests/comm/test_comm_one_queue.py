"""The runner for one hardware queue (``comm/deferring_runner.py``), on real gloo ranks.

Properties:

- no stage issued at a submission waits for a hop issued in that same submission:
  every wait there is for a hop issued at an earlier call (under one hardware queue
  such a wait would hold the pass's kernels queued behind it until the hop is done).
  Checked with the collectives' own caps set so small that the other runners would
  cut each bucket into several chunks and slices: the deferring runner takes one;
- its results are the synchronous call's with chunks of its cap, bit for bit;
- the ranks agree on the runner, or every rank refuses in one line naming who chose what.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm_worlds import WORLDS, battery, error_text, make_input, ranks_per_node_choices
from megatron_sdp4bit import comm
from megatron_sdp4bit.comm import (primitives, quantized_all_gather_weights, quantized_reduce_scatter,
                                   reduce_scatter_plan, weights)
from megatron_sdp4bit.comm.deferring_runner import DeferringRunner
from megatron_sdp4bit.comm.layout import ONE_QUEUE_WHOLE_BUCKET_ELEMENTS
from megatron_sdp4bit.comm.runner_choice import check_same_kind_everywhere
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig

pytestmark = pytest.mark.slow  # real gloo processes


class _Clock:
    """Counts the runner's submissions; a hop remembers the one it was issued in."""

    def __init__(self) -> None:
        self.calls = 0  # submissions so far
        self.call = 0  # the submission running now (0: none)
        self.waits_in_call = []  # (hop's call, waiting call) of every wait inside a submission

    def hop(self, work):
        return _Hop(work, self, self.call)


class _Hop:
    def __init__(self, work, clock: _Clock, issued_in: int):
        self.work, self.clock, self.issued_in = work, clock, issued_in

    def wait(self, *args, **kwargs):
        if self.clock.call:
            self.clock.waits_in_call.append((self.issued_in, self.clock.call))
        return self.work.wait(*args, **kwargs)


def _timed(runner: DeferringRunner, clock: _Clock) -> DeferringRunner:
    """``runner`` whose submissions advance ``clock``."""
    submit = runner.submit

    def counted(job, tensors=()):
        clock.calls += 1
        clock.call = clock.calls
        try:
            return submit(job, tensors)
        finally:
            clock.call = 0  # the handles' waits issue the rest outside any submission

    runner.submit = counted
    return runner


def _bucket_calls(rank: int, world: int, config, runner=None, clock=None) -> list:
    """Three reduce-scatters and two weight gathers of buckets of 8 K elements per rank,
    as a step issues them (RS RS AG AG RS), all submitted before any is waited for."""
    grads = [make_input(rank, 40 + b, world * 8192, torch.float32, integers=False) for b in range(3)]
    models = [make_input(0, 50 + m, world * 8192, torch.bfloat16, integers=False) for m in range(2)]
    mains = [m.view(world, -1)[rank].float() + 0.01 for m in models]
    outs = [torch.empty(8192) for _ in grads]
    grads_space, weights_space = Workspace(), Workspace()
    grads_stream = torch.Generator().manual_seed(7 + rank)
    weights_stream = torch.Generator().manual_seed(8 + rank)
    handles = []
    for kind, index in (("rs", 0), ("rs", 1), ("ag", 0), ("ag", 1), ("rs", 2)):
        if kind == "rs":
            handles.append(quantized_reduce_scatter(
                outs[index], grads[index], op=dist.ReduceOp.AVG, config=config,
                async_op=runner is not None, generator=grads_stream, workspace=grads_space,
                runner=runner))
        else:
            handles.append(quantized_all_gather_weights(
                models[index], mains[index], config=config, async_op=runner is not None,
                generator=weights_stream, workspace=weights_space, runner=runner))
    for handle in handles:
        if handle is not None:
            handle.wait()
    return outs + models


SMALL_CAPS = lambda world: (world * 2048, 1, world * 2048, 1)  # noqa: E731  4 chunks, 4 slices


def _caps(values=None) -> tuple:
    """The collectives' chunk and slice caps; set to ``values`` where given."""
    old = (reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS,
           weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS)
    if values is not None:
        (reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS,
         weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS) = values
    return old


def _deferred_calls(rank: int, world: int, config, whole_bucket_elements) -> tuple:
    """``_bucket_calls`` on a deferring runner with ``whole_bucket_elements``, the hops
    timed: (the clock, the results)."""
    to_all, gather = dist.all_to_all_single, primitives._all_gather_flat
    clock = _Clock()
    dist.all_to_all_single = lambda *a, **k: clock.hop(to_all(*a, **k))
    primitives._all_gather_flat = lambda *a, **k: clock.hop(gather(*a, **k))
    try:
        runner = _timed(DeferringRunner(torch.device("cpu"), whole_bucket_elements), clock)
        return clock, _bucket_calls(rank, world, config, runner, clock)
    finally:
        dist.all_to_all_single, primitives._all_gather_flat = to_all, gather


@battery.case(*WORLDS)
def one_queue_waits(rank: int, world: int) -> list:
    """For every node layout and two limits (the runner's default, which takes these
    buckets whole, and one below them): (rpn, limit, waits inside a submission, those
    for a hop of the same submission, bit-identical to the synchronous calls in the
    chunks the limit implies), with caps that cut each bucket into 4 chunks and 4
    slices where it is not taken whole."""
    defaults = _caps()
    records = []
    try:
        for rpn in ranks_per_node_choices(world):
            comm.get_topology(dist.group.WORLD, rpn)
            config = SDP4BitConfig(ranks_per_node=rpn, rounding="stochastic")
            whole = _bucket_calls(rank, world, config)  # the default caps: one chunk each
            _caps(SMALL_CAPS(world))
            chunked = _bucket_calls(rank, world, config)
            for limit, sync in (("default", whole), ("below", chunked)):
                clock, deferred = _deferred_calls(
                    rank, world, config,
                    ONE_QUEUE_WHOLE_BUCKET_ELEMENTS if limit == "default" else world * 4096)
                same_call = [(issued, now) for issued, now in clock.waits_in_call if issued == now]
                records.append((rpn, limit, len(clock.waits_in_call), same_call,
                                all(torch.equal(a, b) for a, b in zip(sync, deferred))))
            _caps(defaults)
    finally:
        _caps(defaults)
    return records


def test_one_queue_stages_wait_only_for_hops_of_earlier_calls(world):
    assert world * 8192 < ONE_QUEUE_WHOLE_BUCKET_ELEMENTS  # each bucket is one chunk on the runner
    for rank, records in enumerate(battery.results(one_queue_waits, world)):
        assert len(records) == 2 * len(ranks_per_node_choices(world))
        for rpn, limit, waits, same_call, identical in records:
            where = f"rank {rank}, rpn {rpn}, limit {limit}"
            assert waits > 0, f"{where}: no wait ran inside a submission"
            assert identical, f"{where}: differs from the synchronous calls"
            if limit == "default":
                assert not same_call, f"{where}: a submission waited for its own hops: {same_call}"
            else:  # what the whole bucket spares: chunks waiting for one another in one call
                assert same_call, f"{where}: chunked buckets showed no wait in their own call"


@battery.case(*WORLDS)
def kinds_disagree(rank: int, world: int) -> list:
    """What ``check_same_kind_everywhere`` says when all agree, then when the upper half
    of the ranks chose another runner."""
    agree = error_text(lambda: check_same_kind_everywhere("stream"))
    disagree = error_text(lambda: check_same_kind_everywhere(
        "deferred" if rank >= world // 2 else "stream"))
    return [agree, disagree]


def test_ranks_on_different_runners_are_refused_in_one_line(world):
    half = world // 2
    upper = f"{half}" if half == world - 1 else f"{half}-{world - 1}"
    lower = "0" if half == 1 else f"0-{half - 1}"
    for rank, (agree, disagree) in enumerate(battery.results(kinds_disagree, world)):
        assert agree == "", f"rank {rank}: {agree}"
        assert disagree.startswith("RuntimeError: SDP4Bit: the ranks chose different runners"), disagree
        assert f"'stream' on ranks {lower}" in disagree and f"'deferred' on ranks {upper}" in disagree
        assert "CUDA_DEVICE_MAX_CONNECTIONS" in disagree and "\n" not in disagree
