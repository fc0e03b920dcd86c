"""Where a collective's stages run: on the caller, on a worker thread, or on a side stream.

A quantized collective is a chain of stages: quantize, send, wait, sum and
requantize, send, wait, dequantize. Run on the caller's thread and stream, every
wait in that chain holds up whatever the caller does next (on a GPU the compute
stream queues behind each hop; on gloo the thread blocks). A runner takes the
whole chain off that path: ``submit(job)`` issues it and returns at once, and only
the returned handle's ``wait()`` joins the caller with it.

- ``InlineRunner``: the job runs now, on the caller (the synchronous path, and the
  fallback where nothing else can run collectives).
- ``ThreadRunner`` (gloo): one worker thread runs the jobs one after another, in
  the order they were submitted. gloo blocks the calling thread in every wait, so
  only another thread can overlap it. On CUDA tensors (gloo staging them through
  host memory) the worker also runs them on a side stream, ordered after the
  caller's stream at submission.
- ``StreamRunner`` (NCCL): the job's host code runs now, on the caller, but its
  kernels and collectives go to a side stream that first waits for the caller's
  stream; waiting on NCCL blocks no host thread, so nothing is left for a thread.

- ``DeferringRunner`` (``comm/deferring_runner.py``; NCCL with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1``): every stream
  then feeds one hardware queue, where a wait for a hop still in flight blocks the
  pass's kernels queued after it. So a staged job's stages are issued at the caller's
  later calls instead: at each submission every earlier job runs its next stage
  (whose hop was issued one call ago) before the new job's head, and ``wait()``
  issues what is left. The caller's calls are the same on every rank, so the order
  of issue is too. Without a GPU it runs the stages on the caller (tests).

A runner's ``whole_bucket_elements``: a collective it runs over at most that many
elements is one chunk and one weight slice (``layout.whole_bucket``); None leaves the
collectives' own chunks (``MAX_CHUNK_ELEMENTS``).

Side streams outrank the compute stream (``side_stream``): a collective's kernels
start before the pass's queued ones, so its hops are not held up behind a pass.

A job may come in stages (``StagedJob``): its ``head`` may run before the previous
job's deferred ``tail``. The thread runner then overlaps bucket i's last hop (on
the wire) with bucket i + 1's quantization (on the cores): the chain of a step's
buckets costs about max(transfer, arithmetic) per bucket instead of their sum.
The draws from a rounding stream keep the synchronous order (a tail draws none),
and a head touches no buffer a tail uses (``gradients.py`` says why for its own).
The other runners run the stages in order (a stream already queues them).

Every job of a runner is ordered after the previous one (one worker, one stream):
jobs may share buffers (``Workspace``), and every rank issues each process
group's collectives in submission order, which is the same on every rank when the
callers submit in the same order. A thread runner's jobs run beside the caller's
own collectives, so they must use process groups nobody else uses at the same
time (``topology.private_group``): two threads
issuing collectives on one gloo group may pair them wrongly.

A job that raises makes that handle's ``wait()`` raise the same exception, and
every later job on the runner fails without running (the groups it shares with
the failed one are in an unknown state): a failure surfaces, it never hangs.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable, Optional, Sequence

import torch

from megatron_sdp4bit.comm.topology import private_group

logger = logging.getLogger(__name__)

Job = Callable[[], None]

SIDE_STREAM_PRIORITY = -1
"""CUDA stream priority of the runners' side streams (lower is higher; the compute
stream's default is 0; -1 exists on every GPU torch supports, which maps a value past
the device's range to its nearest end)."""


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """A stream for the collectives' kernels that outranks the passes' (``SIDE_STREAM_PRIORITY``).

    Why: when a backward (forward) kernel and a collective's quantization kernel are
    both ready, the block scheduler starts the higher-priority stream's blocks first.
    At the default priority a collective's short kernels queue behind the pass's
    waves, and the next hop's input, hence the wire, waits for them; at high priority
    they slip in between, and the chain of hops keeps the link busy (FSDP2's
    collective streams are high priority for the same reason). NCCL's own kernels
    run on its process group's internal stream, ordered after this one; that
    stream's priority is the group's (``ProcessGroupNCCL.Options``), not set here.
    """
    return torch.cuda.Stream(device=device, priority=SIDE_STREAM_PRIORITY)


class StagedJob:
    """A job a thread runner may interleave with its neighbours: ``head()`` may run
    before the previous job's tail, ``body()`` after it, and ``body()`` returns the
    job's ``tail`` (or None), which may run after the next job's head. Called as a
    plain job, the three run in order.

    The job's author guarantees what makes that safe: a head uses no buffer that an
    earlier job's tail still uses, and a tail draws from no rounding stream (so the
    draws keep the order of the synchronous call)."""

    def __init__(self, head: Job, body: Callable[[], Optional[Job]]) -> None:
        self.head, self.body = head, body

    def __call__(self) -> None:
        self.head()
        tail = self.body()
        if tail is not None:
            tail()


class Completion:
    """The handle of a submitted job, shaped like ``torch.distributed.Work``."""

    def __init__(self, done: Optional[threading.Event] = None,
                 device_done: Optional["torch.cuda.Event"] = None,
                 device: Optional[torch.device] = None,
                 issue_rest: Optional[Callable[[], None]] = None) -> None:
        self._done = done  # set by a worker thread when the job's host part is over
        self._device_done = device_done  # recorded on the side stream after the job
        self._device = device
        self._issue_rest = issue_rest  # a deferring runner's: issue every stage left
        self.error: Optional[BaseException] = None

    def wait(self, timeout=None) -> bool:  # noqa: ARG002  (torch's Work.wait takes one too)
        """Join the caller with the job: the host waits for a thread's job, the caller's
        current stream for the side stream's work. Raises what the job raised."""
        if self._issue_rest is not None and not self.is_completed():
            self._issue_rest()
            if not self.is_completed():  # nothing left to issue it: never block for it
                raise RuntimeError("a deferred collective was not issued by its runner's "
                                   "remaining stages (the runner failed before it)")
        if self._done is not None:
            self._done.wait()
        if self.error is not None:
            raise self.error
        if self._device_done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._device_done)
        return True

    def is_completed(self) -> bool:
        """The host part is done (a side stream's kernels may still be queued)."""
        return self._done is None or self._done.is_set()


def _done_handle(error: Optional[BaseException] = None) -> Completion:
    handle = Completion()
    handle.error = error
    return handle


class InlineRunner:
    """Runs each job at submission, on the caller's thread and stream."""

    kind = "inline"
    whole_bucket_elements = None  # the collectives' own chunks (comm/layout.py)
    private_groups = False  # runs on the caller, in its order: the caller's groups

    def submit(self, job: Job, tensors: Sequence[torch.Tensor] = ()) -> Completion:  # noqa: ARG002
        job()
        return _done_handle()

    def group_for(self, group):
        return group

    def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


class StreamRunner:
    """NCCL: the job's kernels and collectives on a side stream of ``device``."""

    kind = "stream"
    whole_bucket_elements = None  # the collectives' own chunks (comm/layout.py)
    # NCCL runs one communicator's collectives in the order they were issued, whatever
    # stream issued them. On megatron's own data-parallel group, the weight gathers
    # submitted at the optimizer step would hold up the collective megatron issues right
    # after it on that group (Megatron-LM's loss all-reduce, on the compute stream): the
    # next forward pass would wait for every gather. Private twins keep them apart.
    private_groups = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = side_stream(self.device)

    def submit(self, job: Job, tensors: Sequence[torch.Tensor] = ()) -> Completion:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            job()
        for tensor in tensors:  # the caller may free them before the side stream is done
            tensor.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return Completion(device_done=done, device=self.device)

    def group_for(self, group):
        """The private twin of ``group`` (``private_groups``; raises when
        ``topology.build_private_groups`` made none for it)."""
        return private_group(group)

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        """Join the compute stream with the side stream, and the host with both: the
        process groups may be destroyed next, which must not happen under hops still
        in flight (NCCL may then hang or fail at exit)."""
        self.drain()
        self.stream.synchronize()


class ThreadRunner:
    """gloo: one worker thread runs the jobs in submission order.

    Its jobs use the private twins of the groups a caller names (``group_for``:
    ``topology.private_group``, built on every rank beforehand). The runner keeps
    no process group itself, so none outlives ``topology.forget_subgroups``.
    """

    kind = "thread"
    whole_bucket_elements = None  # the collectives' own chunks (comm/layout.py)
    private_groups = True  # two threads issuing collectives on one gloo group may pair them wrongly

    def __init__(self, device: torch.device, name: str = "sdp4bit-collectives") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._failure: Optional[BaseException] = None
        self._pid = os.getpid()
        self._closed = False
        self._stream = side_stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def stream(self) -> Optional["torch.cuda.Stream"]:
        """The worker's side stream on CUDA tensors (None on CPU tensors)."""
        return self._stream

    def group_for(self, group):
        """The private twin of ``group``, which only this runner's jobs use (raises when
        ``topology.build_private_groups`` made none for it)."""
        return private_group(group)

    def submit(self, job: Job, tensors: Sequence[torch.Tensor] = ()) -> Completion:
        if os.getpid() != self._pid:
            raise RuntimeError("this collective runner was made in another process (before a "
                               "fork); install the layer in the process that trains")
        if self._closed:
            raise RuntimeError("this collective runner is closed (the layer was uninstalled)")
        if self._failure is not None:
            return _done_handle(failed_before(self._failure))
        ready = None
        if self._stream is not None:  # the side stream starts after the caller's work so far
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        handle = Completion(done=threading.Event(), device=self.device,
                            device_done=torch.cuda.Event() if self._stream is not None else None)
        self._jobs.put((job, tuple(tensors), ready, handle))
        return handle

    def drain(self) -> None:
        """Wait until every job submitted so far has run (errors are left to their handles)."""
        if self._closed or not self._thread.is_alive():
            return
        marker = threading.Event()
        self._jobs.put(marker)
        marker.wait()

    def close(self) -> None:
        """Run what is queued, then stop the worker. A worker stuck in a collective (a
        peer died) is left behind as a daemon after 60 s rather than hanging the caller."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.device)
        deferred = None  # (tail, tensors, handle) of the last job, whose tail waits
        while True:
            if deferred is not None and self._jobs.empty():
                # nothing to overlap it with: finish it now rather than hold its waiter
                deferred = self._finish(*deferred)
            item = self._jobs.get()
            if item is None or isinstance(item, threading.Event):
                if deferred is not None:  # drain and close complete every job first
                    deferred = self._finish(*deferred)
                if item is None:
                    return
                item.set()
                continue
            job, tensors, ready, handle = item
            item = None  # the job and its tensors are not kept past it
            head, body = (job.head, job.body) if isinstance(job, StagedJob) else (None, job)
            job = None
            ok, _ = self._attempt(handle, head, ready)
            if deferred is not None:  # the earlier job's tail, after this one's head
                deferred = self._finish(*deferred)
            ok, tail = self._attempt(handle, body) if ok else (False, None)
            if head is None:
                tail = None  # a plain job's result is no tail
            head = body = None
            if tail is not None:
                deferred = (tail, tensors, handle)
            else:
                self._complete(tensors, handle)
            tensors = tail = None

    def _attempt(self, handle: Completion, part: Optional[Callable], ready=None) -> tuple:
        """``(ok, result)`` of running ``part`` (None: nothing) on the runner's stream,
        that stream first made to wait for the submitter's work (``ready``). An error
        goes to ``handle`` and fails every later job; after an earlier failure nothing
        runs."""
        try:
            if self._failure is not None:
                raise failed_before(self._failure)
            with torch.no_grad():
                if self._stream is None:
                    return True, part() if part is not None else None
                if ready is not None:
                    self._stream.wait_event(ready)
                with torch.cuda.stream(self._stream):
                    return True, part() if part is not None else None
        except BaseException as error:  # handed to the waiter, never lost
            handle.error = error
            if self._failure is None:
                self._failure = error
            return False, None

    def _finish(self, tail: Job, tensors, handle: Completion) -> None:
        """Run a deferred tail and complete its job; returns None. A failure since its
        body ran does not skip it: its hops are in flight, and it is that job's to
        finish (an error of its own goes to its handle)."""
        failure, self._failure = self._failure, None
        try:
            self._attempt(handle, tail)
        finally:
            self._failure = failure or self._failure
        self._complete(tensors, handle)
        return None

    def _complete(self, tensors, handle: Completion) -> None:
        """The job is over on the host: its tensors recorded on the side stream, its
        device event recorded after its work, its waiter released. A failure here (a
        CUDA error) goes to the handle and fails every later job, as a job's own does:
        the worker lives on, so no later waiter hangs."""
        error = record_completion(self._stream, tensors, handle)
        if error is not None and self._failure is None:
            self._failure = error


def record_completion(stream, tensors, handle: Completion) -> Optional[BaseException]:
    """A job is over on the host: on CUDA its tensors recorded on ``stream`` (the caller
    may free them before the stream is done) and its event after its work; its waiter
    released. Returns the error recording raised (a CUDA error), which is also the
    handle's, or None."""
    try:
        if stream is not None:
            for tensor in tensors:
                tensor.record_stream(stream)
            handle._device_done.record(stream)
        return None
    except BaseException as error:  # handed to the waiter, never lost
        handle.error = handle.error or error
        return error
    finally:
        handle._done.set()


def failed_before(error: BaseException) -> RuntimeError:
    failure = RuntimeError(f"an earlier collective of this runner failed ({type(error).__name__}: "
                           f"{error}); later ones are not run")
    failure.__cause__ = error
    return failure


def run_or_submit(runner, job: Job, async_op: bool, tensors: Sequence[torch.Tensor] = ()):
    """torch's convention over a runner: with ``async_op`` the job is submitted and its
    handle returned; without, it runs to completion (through the runner, the one that
    may use its groups) and None is returned. No runner: the job runs now, here."""
    if runner is None:
        job()
        return _done_handle() if async_op else None
    handle = runner.submit(job, tensors)
    if async_op:
        return handle
    handle.wait()
    return None
