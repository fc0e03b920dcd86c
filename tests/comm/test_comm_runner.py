"""comm/runner.py: collectives handed to a worker thread, on real gloo ranks.

Properties checked against the synchronous call and the exact collective:

- a collective submitted to a ``ThreadRunner`` is bit-identical to the same call run
  synchronously, for both directions, fp32 and bf16, one and several chunks, one and
  two levels, nearest and stochastic rounding (the same draws in the same order);
- the call returns before its collective is done (a peer that starts late does not
  hold the caller), and the caller's own collectives on the original group run
  meanwhile without pairing with the runner's (the runner uses a private twin);
- buckets submitted back to back, whose stages the worker interleaves (the next
  bucket's first quantization before the previous one's last write), give the
  synchronous results of the same calls one after another, on one workspace and
  one rounding stream, with a weight gather between them;
- a job that fails makes its wait raise, and every later job fails without running;
- a deferring runner (one hardware queue) issues a job's stages at the later calls, in
  the order the thread runner allows, and gives the synchronous results bit for bit.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from comm_worlds import WORLDS, battery, make_input, ranks_per_node_choices
from megatron_sdp4bit import comm
from megatron_sdp4bit.comm import quantized_all_gather_weights, quantized_reduce_scatter, reduce_scatter_plan
from megatron_sdp4bit.comm.deferring_runner import DeferringRunner
from megatron_sdp4bit.comm.runner import InlineRunner, StagedJob, ThreadRunner, run_or_submit
from megatron_sdp4bit.comm.topology import build_private_groups
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig

pytestmark = pytest.mark.slow  # real gloo processes

DTYPES = (torch.float32, torch.bfloat16)
LATE_START_S = 1.0  # how long the late rank waits before its call


def _runner(world: int) -> ThreadRunner:
    """A worker thread with a private twin of the world (collective: every rank calls it)."""
    build_private_groups([list(range(world))])
    return ThreadRunner(torch.device("cpu"))


def _reduce_scatter(x, config, seed, runner=None, group=None):
    out = torch.empty(x.numel() // dist.get_world_size(), dtype=x.dtype)
    handle = quantized_reduce_scatter(
        out, x, op=dist.ReduceOp.AVG, group=group, config=config, async_op=runner is not None,
        generator=torch.Generator().manual_seed(seed), workspace=Workspace(), runner=runner)
    if handle is not None:
        handle.wait()
    return out


def _gather(model, main, config, seed, runner=None, group=None):
    model = model.clone()
    handle = quantized_all_gather_weights(
        model, main, group=group, config=config, async_op=runner is not None,
        generator=torch.Generator().manual_seed(seed), workspace=Workspace(), runner=runner)
    if handle is not None:
        handle.wait()
    return model


@battery.case(*WORLDS)
def runner_equals_sync(rank: int, world: int) -> list:
    """(rpn, rounding, dtype, chunks, direction, bit-identical) for every combination."""
    runner = _runner(world)
    twin = runner.group_for(dist.group.WORLD)
    records = []
    caps = reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS
    try:
        for rpn in ranks_per_node_choices(world):
            comm.get_topology(twin, rpn)  # built here, on the caller (a collective over it)
            for rounding in ("nearest", "stochastic"):
                for dtype in DTYPES:
                    for chunks in (1, 3):
                        # a small cap: a bucket of many chunks, several in flight
                        reduce_scatter_plan.MAX_CHUNK_ELEMENTS = world * 256 if chunks > 1 else caps[0]
                        reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS = 1
                        config = SDP4BitConfig(ranks_per_node=rpn, rounding=rounding,
                                               pipeline_chunks=chunks)
                        x = make_input(rank, 7, world * 2050, dtype, integers=False)
                        sync = _reduce_scatter(x, config, 11 + rank)
                        overlapped = _reduce_scatter(x, config, 11 + rank, runner, twin)
                        records.append((rpn, rounding, str(dtype), chunks, "reduce_scatter",
                                        torch.equal(sync, overlapped)))
                        model = make_input(0, 3, world * 5000, dtype, integers=False)
                        main = model.view(world, -1)[rank].float() + 0.01 * make_input(
                            rank, 4, 5000, torch.float32, integers=False)
                        sync = _gather(model, main, config, 13 + rank)
                        overlapped = _gather(model, main, config, 13 + rank, runner, twin)
                        records.append((rpn, rounding, str(dtype), chunks, "all_gather",
                                        torch.equal(sync, overlapped)))
    finally:
        reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS = caps
        runner.close()
    return records


def test_a_runner_gives_the_synchronous_result_bit_for_bit(world):
    for rank, records in enumerate(battery.results(runner_equals_sync, world)):
        assert len(records) == 2 * 2 * 2 * 2 * len(ranks_per_node_choices(world))
        different = [r for r in records if not r[-1]]
        assert not different, f"rank {rank}: overlapped differs from sync for {different}"


def _back_to_back(rank: int, world: int, runner) -> list:
    """(rpn, dtype, chunks, bit-identical) of three reduce-scatters and two weight
    gathers, each kind after each kind, as the layer issues a step's buckets: one
    workspace per direction, one rounding stream each, every call submitted before any
    is waited for; 1 or 3 chunks (and weight slices) per call. On a thread runner a
    first job holds the worker until all five are queued, so that they interleave."""
    from megatron_sdp4bit.comm import weights

    twin = runner.group_for(dist.group.WORLD)
    caps = reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS
    slice_caps = weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS
    records = []
    try:
        for rpn in ranks_per_node_choices(world):
            comm.get_topology(twin, rpn)
            for dtype in DTYPES:
                for chunks in (1, 3):
                    reduce_scatter_plan.MAX_CHUNK_ELEMENTS = world * 256 if chunks > 1 else caps[0]
                    reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS = 1
                    # weight slices of 2 groups (2 x 2048 per rank): 2 or 3 slices a gather
                    weights.MAX_CHUNK_ELEMENTS = world * 4096 if chunks > 1 else slice_caps[0]
                    weights.MIN_SLICE_ELEMENTS = 1
                    config = SDP4BitConfig(ranks_per_node=rpn, rounding="stochastic",
                                           pipeline_chunks=chunks)
                    # buckets of other sizes: the second one's plan grows the buffers
                    buckets = [make_input(rank, 30 + b, world * n, dtype, integers=False)
                               for b, n in enumerate((1024, 2050, 512))]
                    models = [make_input(0, 3 + m, world * n, dtype, integers=False)
                              for m, n in enumerate((10240, 6144))]
                    mains = [m.view(world, -1)[rank].float() + 0.01 for m in models]
                    results = {}
                    for mode, use in (("sync", None), ("runner", runner)):
                        grads_stream = torch.Generator().manual_seed(5 + rank)
                        weights_stream = torch.Generator().manual_seed(6 + rank)
                        grads_space, weights_space = Workspace(), Workspace()
                        outs = [torch.empty(x.numel() // world, dtype=dtype) for x in buckets]
                        gathered = [m.clone() for m in models]
                        handles = []
                        gate = threading.Event()
                        if use is not None and use.kind == "thread":  # all five queued before
                            handles.append(use.submit(gate.wait))  # the first runs: they
                            # interleave (head i + 1 before tail i)
                        # each kind after each kind: RS RS AG AG RS
                        for kind, index in (("rs", 0), ("rs", 1), ("ag", 0), ("ag", 1), ("rs", 2)):
                            if kind == "rs":
                                handles.append(quantized_reduce_scatter(
                                    outs[index], buckets[index], op=dist.ReduceOp.AVG,
                                    group=twin if use else None, config=config,
                                    async_op=use is not None, generator=grads_stream,
                                    workspace=grads_space, runner=use))
                                continue
                            handles.append(quantized_all_gather_weights(
                                gathered[index], mains[index], group=twin if use else None,
                                config=config, async_op=use is not None,
                                generator=weights_stream, workspace=weights_space, runner=use))
                        gate.set()
                        for handle in handles:
                            if handle is not None:
                                handle.wait()
                        results[mode] = outs + gathered
                    records.append((rpn, str(dtype), chunks, all(
                        torch.equal(a, b) for a, b in zip(results["sync"], results["runner"]))))
    finally:
        reduce_scatter_plan.MAX_CHUNK_ELEMENTS, reduce_scatter_plan.MIN_CHUNK_SHARD_ELEMENTS = caps
        weights.MAX_CHUNK_ELEMENTS, weights.MIN_SLICE_ELEMENTS = slice_caps
        runner.close()
    return records


@battery.case(*WORLDS)
def back_to_back_equals_sync(rank: int, world: int) -> list:
    return _back_to_back(rank, world, _runner(world))


@battery.case(*WORLDS)
def deferred_back_to_back_equals_sync(rank: int, world: int) -> list:
    """The same on a deferring runner (one hardware queue): each call's stages issued at
    the next calls, the rest at the first wait. It takes no bucket whole here, so that
    calls have the several chunks and slices of the collectives' own (small) caps, as a
    bucket above its limit has (tests/comm/test_comm_one_queue.py checks the limit)."""
    return _back_to_back(rank, world, DeferringRunner(torch.device("cpu"), whole_bucket_elements=None))


@pytest.mark.parametrize("case", [back_to_back_equals_sync, deferred_back_to_back_equals_sync],
                         ids=["thread", "deferred"])
def test_buckets_back_to_back_on_a_runner_give_the_synchronous_results(world, case):
    for rank, records in enumerate(battery.results(case, world)):
        assert len(records) == 2 * 2 * len(ranks_per_node_choices(world))
        different = [r for r in records if not r[-1]]
        assert not different, f"rank {rank}: back-to-back buckets differ from sync for {different}"


@battery.case(2, 4)
def overlap(rank: int, world: int) -> dict:
    """The last rank starts its reduce-scatter LATE_START_S late. Every other rank's call
    must return at once (the collective waits on the worker, not on the caller), and the
    caller's all-reduce on the world group, issued right after, must pair with the late
    rank's all-reduce, not with the runner's collectives."""
    runner = _runner(world)
    twin = runner.group_for(dist.group.WORLD)
    config = SDP4BitConfig(ranks_per_node=2 if world > 2 else world, rounding="nearest")
    comm.get_topology(twin, config.ranks_per_node)
    x = make_input(rank, 21, world * 4096, torch.float32, integers=False)
    expected = _reduce_scatter(x, config, 0)
    dist.barrier()
    late = rank == world - 1
    if late:
        token = torch.tensor([float(rank)])
        dist.all_reduce(token)  # the caller's collective first, then the late start
        time.sleep(LATE_START_S)
    out = torch.empty_like(expected)
    started = time.perf_counter()
    handle = quantized_reduce_scatter(out, x, op=dist.ReduceOp.AVG, group=twin, config=config,
                                      async_op=True, workspace=Workspace(), runner=runner)
    returned_after = time.perf_counter() - started
    in_flight = not handle.is_completed()
    if not late:
        token = torch.tensor([float(rank)])
        dist.all_reduce(token)  # on the world group while the runner's collective waits
    handle.wait()
    waited = time.perf_counter() - started
    runner.close()
    return {"late": late, "returned_after": returned_after, "in_flight": in_flight,
            "waited": waited, "token": float(token), "equal": torch.equal(out, expected)}


@pytest.mark.parametrize("size", [2, 4])
def test_a_submitted_collective_returns_at_once_and_runs_beside_the_callers_own(size):
    if size > max(WORLDS):
        pytest.skip("world too large")
    results = battery.results(overlap, size)
    total = float(sum(range(size)))
    for rank, r in enumerate(results):
        assert r["equal"], f"rank {rank}: the overlapped result differs from the synchronous one"
        assert r["token"] == total, f"rank {rank}: the caller's all-reduce paired wrongly: {r}"
        if not r["late"]:
            assert r["returned_after"] < 0.25 * LATE_START_S, r  # did not wait for the late rank
            assert r["in_flight"], r
            assert r["waited"] >= 0.8 * LATE_START_S, r  # wait() joined the late collective


def test_a_failed_job_raises_at_its_wait_and_later_jobs_do_not_run():
    runner = ThreadRunner(torch.device("cpu"))
    ran = []

    def fail():
        raise ValueError("boom")

    try:
        first = runner.submit(fail)
        second = runner.submit(lambda: ran.append(True))
        with pytest.raises(ValueError, match="boom"):
            first.wait()
        with pytest.raises(RuntimeError, match="earlier collective of this runner failed"):
            second.wait()
        third = runner.submit(lambda: ran.append(True))
        with pytest.raises(RuntimeError, match="earlier collective"):
            third.wait()
        assert ran == []
    finally:
        runner.close()


def test_jobs_run_in_submission_order_on_one_thread_and_close_runs_what_is_queued():
    runner = ThreadRunner(torch.device("cpu"))
    order, threads = [], set()
    import threading

    def job(i):
        time.sleep(0.01 * (5 - i))  # later jobs are quicker: order must still hold
        order.append(i)
        threads.add(threading.current_thread().name)

    handles = [runner.submit(lambda i=i: job(i)) for i in range(5)]
    runner.close()
    assert order == list(range(5))
    assert threads == {"sdp4bit-collectives"} and threading.current_thread().name not in threads
    assert all(h.is_completed() for h in handles)
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(lambda: None)


def test_without_a_runner_or_inline_the_job_runs_at_the_call():
    ran = []
    assert run_or_submit(None, lambda: ran.append(1), async_op=False) is None
    handle = run_or_submit(None, lambda: ran.append(2), async_op=True)
    assert handle.is_completed() and handle.wait() and ran == [1, 2]
    handle = run_or_submit(InlineRunner(), lambda: ran.append(3), async_op=True)
    assert handle.is_completed() and ran == [1, 2, 3]


def _staged(log, name, gate=None, fail_in=None):
    """A StagedJob that logs its stages; its head waits for ``gate`` first."""
    def head():
        if gate is not None:
            gate.wait()
        if fail_in == "head":
            raise ValueError(f"{name} head")
        log.append(f"{name} head")

    def tail():
        if fail_in == "tail":
            raise ValueError(f"{name} tail")
        log.append(f"{name} tail")

    def body():
        log.append(f"{name} body")
        return tail

    return StagedJob(head, body)


def test_the_next_jobs_head_runs_before_the_previous_jobs_tail():
    """Queued jobs interleave: head 2 between body 1 and tail 1; a plain job comes after
    the tail before it; the last job's tail runs without a next job to wait for."""
    import threading

    runner = ThreadRunner(torch.device("cpu"))
    log, gate = [], threading.Event()
    try:
        first = runner.submit(_staged(log, "1", gate))
        second = runner.submit(_staged(log, "2"))
        plain = runner.submit(lambda: log.append("plain"))
        third = runner.submit(_staged(log, "3"))
        gate.set()  # all four are queued before the first head runs
        third.wait()
        assert log == ["1 head", "1 body", "2 head", "1 tail", "2 body", "2 tail", "plain",
                       "3 head", "3 body", "3 tail"]
        assert all(h.is_completed() for h in (first, second, plain))
        lone = runner.submit(_staged(log, "4"))
        lone.wait()  # nothing after it: its tail is not held back
        assert log[-1] == "4 tail"
    finally:
        runner.close()


def test_a_failing_head_leaves_the_earlier_job_to_finish_and_fails_the_later_ones():
    import threading

    runner = ThreadRunner(torch.device("cpu"))
    log, gate = [], threading.Event()
    try:
        first = runner.submit(_staged(log, "1", gate))
        second = runner.submit(_staged(log, "2", fail_in="head"))
        third = runner.submit(_staged(log, "3"))
        gate.set()
        assert first.wait()  # its hops were in flight: it finishes, unharmed
        with pytest.raises(ValueError, match="2 head"):
            second.wait()
        with pytest.raises(RuntimeError, match="earlier collective"):
            third.wait()
        assert log == ["1 head", "1 body", "1 tail"]
    finally:
        runner.close()


def _wait_within(handle, seconds: float):
    """``handle.wait()``, failing the test (not hanging it) if it has not returned within
    ``seconds``."""
    outcome = []

    def wait():
        try:
            outcome.append(handle.wait())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(seconds)
    assert outcome, f"wait() did not return within {seconds} s"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def test_a_failing_deferred_tail_fails_its_own_job_and_the_later_ones_not_the_next_head():
    """A tail deferred past the next job's head fails its own handle; the next job, whose
    head already ran, fails as an earlier failure's successor; nothing hangs."""
    import threading

    runner = ThreadRunner(torch.device("cpu"))
    log, gate = [], threading.Event()
    try:
        first = runner.submit(_staged(log, "1", gate, fail_in="tail"))
        second = runner.submit(_staged(log, "2"))
        third = runner.submit(lambda: log.append("plain"))
        gate.set()
        with pytest.raises(ValueError, match="1 tail"):
            first.wait()
        with pytest.raises(RuntimeError, match="earlier collective"):
            second.wait()
        with pytest.raises(RuntimeError, match="earlier collective"):
            third.wait()
        assert log[:3] == ["1 head", "1 body", "2 head"] and "plain" not in log
    finally:
        runner.close()


def _fail_the_first_completion(runner, stream_attribute: str) -> None:
    """The runner's first job completion fails as a CUDA error would (record_stream is
    called on a plain tensor, with a stand-in stream); later ones complete as usual."""
    original, calls = runner._complete, []

    def complete(tensors, handle):
        calls.append(handle)
        if len(calls) > 1:
            return original(tensors, handle)
        setattr(runner, stream_attribute, object())
        try:
            original([torch.zeros(1)], handle)  # raises: no stream
        finally:
            setattr(runner, stream_attribute, None)

    runner._complete = complete


def test_a_failure_while_completing_a_job_fails_the_later_ones_and_hangs_none():
    """Completing a job (on CUDA: recording its tensors and event on the side stream) may
    fail; the worker lives on: its waiter sees the error and later waiters fail fast."""
    runner = ThreadRunner(torch.device("cpu"))
    _fail_the_first_completion(runner, "_stream")
    try:
        first = runner.submit(lambda: None)
        with pytest.raises(RuntimeError, match="unknown parameter type"):  # no stream
            _wait_within(first, 30)
        second = runner.submit(lambda: None)
        with pytest.raises(RuntimeError, match="earlier collective"):
            _wait_within(second, 30)
    finally:
        runner.close()


def test_a_staged_job_called_plainly_runs_its_stages_in_order():
    log = []
    assert run_or_submit(InlineRunner(), _staged(log, "x"), async_op=False) is None
    assert log == ["x head", "x body", "x tail"]


def test_a_deferring_runner_issues_each_stage_at_the_next_call_in_the_thread_runners_order():
    """One hardware queue: a job's body at the next submission, its tail at the one after
    (a tail before the next job's body, a body before the next job's head); a plain job
    at once; the first wait issues every stage left; nothing runs between calls."""
    runner = DeferringRunner(torch.device("cpu"))
    log = []
    first = runner.submit(_staged(log, "1"))
    assert log == ["1 head"] and not first.is_completed()
    second = runner.submit(_staged(log, "2"))
    assert log == ["1 head", "1 body", "2 head"]
    plain = runner.submit(lambda: log.append("plain"))
    assert log[3:] == ["1 tail", "2 body", "plain"] and first.is_completed() and plain.is_completed()
    third = runner.submit(_staged(log, "3"))
    assert log[6:] == ["2 tail", "3 head"] and second.is_completed()
    assert third.wait() and log[8:] == ["3 body", "3 tail"]
    runner.submit(_staged(log, "4"))
    runner.drain()
    assert log[10:] == ["4 head", "4 body", "4 tail"]


def test_a_deferring_runner_fails_the_failing_job_and_the_parked_ones_and_later_calls():
    runner = DeferringRunner(torch.device("cpu"))
    log = []
    first = runner.submit(_staged(log, "1", fail_in="tail"))
    second = runner.submit(_staged(log, "2"))  # runs 1's body
    with pytest.raises(ValueError, match="1 tail"):  # 1's tail fails at the next call
        runner.submit(_staged(log, "3"))
    with pytest.raises(ValueError, match="1 tail"):
        _wait_within(first, 30)
    with pytest.raises(RuntimeError, match="earlier collective"):
        _wait_within(second, 30)
    with pytest.raises(RuntimeError, match="earlier collective"):
        runner.submit(lambda: log.append("later"))
    assert log == ["1 head", "1 body", "2 head"]


def test_a_deferring_runner_that_fails_to_complete_a_job_hangs_no_waiter():
    """Completing a job (on CUDA: recording its tensors and event) may fail at a later
    call; that job's wait raises instead of blocking, and later calls fail fast."""
    runner = DeferringRunner(torch.device("cpu"))
    log = []
    _fail_the_first_completion(runner, "stream")
    first = runner.submit(_staged(log, "1"))
    second = runner.submit(_staged(log, "2"))  # 1's body
    with pytest.raises(RuntimeError, match="earlier collective"):
        runner.submit(_staged(log, "3"))  # 1's tail: completing it fails; nothing more runs
    with pytest.raises(RuntimeError, match="unknown parameter type"):
        _wait_within(first, 30)
    with pytest.raises(RuntimeError, match="earlier collective"):
        _wait_within(second, 30)
    with pytest.raises(RuntimeError, match="earlier collective"):
        runner.submit(lambda: None)
    assert log == ["1 head", "1 body", "2 head", "1 tail"]
