"""comm/runner.py on CUDA, without a GPU: the stream and event calls, in their order.

A side stream is only correct if it starts after the compute stream's work so far
(the gradients it reads), if the compute stream waits for it only where the caller
waits on the handle, and if the tensors it uses stay allocated until it is done.
These orders are what a GPU would get wrong silently (a race, not an error), so they
are checked here against a stand-in of ``torch.cuda`` that logs every call; on a GPU,
scripts/gpu_check.sh runs the runners for real (its overlap step).
"""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from megatron_sdp4bit.comm import runner_choice
from megatron_sdp4bit.comm.deferring_runner import DeferringRunner
from megatron_sdp4bit.comm.runner import StagedJob, StreamRunner, ThreadRunner


class FakeCuda:
    """Streams and events that log what is done with them."""

    def __init__(self):
        self.log = []
        self.current = self.Stream(name="compute")
        self.active = threading.local()

    def Stream(self, device=None, priority=0, name=None):  # noqa: N802  (torch.cuda's name)
        cuda = self
        name = name or f"side{sum(1 for e in cuda.log if e[0] == 'new stream' and e[1] != 'compute')}"
        cuda.log.append(("new stream", name))

        class S:
            def __init__(self):
                self.priority = priority

            def __repr__(self):
                return name

            def wait_stream(self, other):
                cuda.log.append(("wait_stream", name, repr(other)))

            def wait_event(self, event):
                cuda.log.append(("wait_event", name, event.name))

            def synchronize(self):  # the host waits for this stream's work
                cuda.log.append(("synchronize", name))

        return S()

    def Event(self):  # noqa: N802
        cuda = self
        index = sum(1 for e in cuda.log if e[0] == "new event")
        cuda.log.append(("new event", f"event{index}"))

        class E:
            name = f"event{index}"

            def record(self, stream=None):
                cuda.log.append(("record", self.name, repr(stream)))

        return E()

    def current_stream(self, device=None):
        return getattr(self.active, "stream", self.current)

    @contextlib.contextmanager
    def stream(self, s):
        previous = getattr(self.active, "stream", self.current)
        self.active.stream = s
        self.log.append(("enter", repr(s)))
        try:
            yield
        finally:
            self.active.stream = previous
            self.log.append(("exit", repr(s)))

    def set_device(self, device):
        self.log.append(("set_device", str(device)))

    def current_device(self):
        return 0


class FakeTensor:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def record_stream(self, stream):
        self.cuda.log.append(("record_stream", self.name, repr(stream)))


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("Stream", "Event", "current_stream", "stream", "set_device", "current_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def _job(cuda, name):
    def job():
        cuda.log.append(("job", name, repr(cuda.current_stream())))
    return job


def test_a_side_stream_starts_after_the_callers_work_and_the_caller_waits_only_in_wait(cuda):
    side = StreamRunner(torch.device("cuda", 0))
    handle = side.submit(_job(cuda, "rs"), (FakeTensor(cuda, "grads"),))
    log = [e for e in cuda.log if e[0] != "new stream"]
    assert log == [("wait_stream", "side0", "compute"),  # after the gradients' kernels
                   ("enter", "side0"), ("job", "rs", "side0"), ("exit", "side0"),
                   ("record_stream", "grads", "side0"),  # not reused before side0 is done
                   ("new event", "event0"), ("record", "event0", "side0")]
    assert not any(e[0] == "wait_event" for e in cuda.log)  # the caller did not wait yet
    handle.wait()
    assert cuda.log[-1] == ("wait_event", "compute", "event0")


def test_a_worker_thread_on_cuda_runs_its_jobs_on_a_side_stream_after_the_submitters_work(cuda):
    worker = ThreadRunner(torch.device("cuda", 0))
    try:
        handle = worker.submit(_job(cuda, "rs"), (FakeTensor(cuda, "grads"),))
        handle.wait()
    finally:
        worker.close()
    log = [e for e in cuda.log if e[0] not in ("new stream", "new event")]
    ready = ("record", "event0", "compute")  # recorded on the submitter's stream
    assert log.index(ready) < log.index(("wait_event", "side0", "event0"))
    assert ("set_device", "cuda:0") in log
    job = log.index(("job", "rs", "side0"))  # the worker's current stream is the side one
    assert log.index(("wait_event", "side0", "event0")) < job
    assert log.index(("record_stream", "grads", "side0")) > job
    done = log.index(("record", "event1", "side0"))
    assert done > job and log[-1] == ("wait_event", "compute", "event1")


@pytest.mark.parametrize("make", [StreamRunner, ThreadRunner, DeferringRunner])
def test_side_streams_outrank_the_compute_stream(cuda, make):
    # lower is higher on CUDA: the collectives' kernels start before the pass's queued ones
    runner = make(torch.device("cuda", 0))
    try:
        side = runner.stream
        assert side.priority < cuda.current.priority == 0
    finally:
        runner.close()


@pytest.mark.parametrize("make", [StreamRunner, DeferringRunner])
def test_close_orders_the_caller_and_the_host_after_the_side_stream(cuda, make):
    """The process groups may be destroyed right after close: with hops still in flight
    on the side stream NCCL may hang or fail at exit, so the host waits for them."""
    side = make(torch.device("cuda", 0))
    side.close()
    assert cuda.log[-2:] == [("wait_stream", "compute", "side0"), ("synchronize", "side0")]


def test_a_side_stream_runs_on_private_twins_of_the_callers_groups(cuda, monkeypatch):
    """NCCL runs one communicator's collectives in the order they were issued: on
    megatron's own data-parallel group, its loss all-reduce right after the optimizer step
    would wait for every weight gather the stream runner prefetched there, and the next
    forward pass with it. The deferring runner issues in the caller's order: its own."""
    from megatron_sdp4bit.comm import runner as runner_module

    monkeypatch.setattr(runner_module, "private_group", lambda group: ("twin of", group))
    side = StreamRunner(torch.device("cuda", 0))
    assert side.private_groups and side.group_for("dp group") == ("twin of", "dp group")
    deferring = DeferringRunner(torch.device("cuda", 0))
    assert not deferring.private_groups and deferring.group_for("dp group") == "dp group"


def test_drain_orders_the_caller_after_the_side_stream_and_leaves_the_host_free(cuda):
    side = StreamRunner(torch.device("cuda", 0))
    side.drain()
    assert cuda.log[-1] == ("wait_stream", "compute", "side0")
    assert not any(e[0] == "synchronize" for e in cuda.log)


def test_the_runner_kind_follows_the_backend_that_serves_the_device(monkeypatch):
    class Group:
        def __init__(self, backend):
            self.backend = backend

        def _get_backend(self, device):
            class B:
                def name(_self):
                    return self.backend[torch.device(device).type]
            return B()

    mixed = Group({"cpu": "gloo", "cuda": "nccl"})
    assert runner_choice.runner_kind(mixed, torch.device("cuda", 0)) == "stream"
    assert runner_choice.runner_kind(mixed, torch.device("cpu")) == "thread"
    assert runner_choice.runner_kind(Group({"cpu": "mpi", "cuda": "mpi"}), "cpu") == "inline"
    assert runner_choice.runner_kind(Group({"cpu": "gloo", "cuda": "gloo"}), "cuda") == "thread"


def _staged_job(cuda, name):
    def stage(part, after=None):
        def run():
            cuda.log.append(("job", f"{name} {part}", repr(cuda.current_stream())))
            return after
        return run

    return StagedJob(stage("head"), stage("body", stage("tail")))


def test_a_deferring_runner_runs_every_stage_on_its_side_stream_and_orders_only_new_jobs(cuda):
    """One hardware queue: a new job's head waits for the caller's stream (the gradients);
    a later stage of an earlier job adds no such wait (its inputs were ready at its own
    submission); a job's tensors and event are recorded when its last stage is issued,
    and the caller's stream waits for it only in wait(), after every stage is issued."""
    runner = DeferringRunner(torch.device("cuda", 0))
    first = runner.submit(_staged_job(cuda, "1"), (FakeTensor(cuda, "grads1"),))
    runner.submit(_staged_job(cuda, "2"), (FakeTensor(cuda, "grads2"),))
    log = [e for e in cuda.log if e[0] not in ("new stream", "enter", "exit")]
    assert log == [("new event", "event0"),
                   ("wait_stream", "side0", "compute"), ("job", "1 head", "side0"),
                   ("job", "1 body", "side0"),  # at the next submission, with no new wait
                   ("new event", "event1"),
                   ("wait_stream", "side0", "compute"), ("job", "2 head", "side0")]
    first.wait()  # issues 1's tail (done: recorded), then 2's body and tail
    log = [e for e in cuda.log if e[0] not in ("new stream", "enter", "exit")][len(log):]
    assert log == [("job", "1 tail", "side0"), ("record_stream", "grads1", "side0"),
                   ("record", "event0", "side0"), ("job", "2 body", "side0"),
                   ("job", "2 tail", "side0"), ("record_stream", "grads2", "side0"),
                   ("record", "event1", "side0"), ("wait_event", "compute", "event0")]
