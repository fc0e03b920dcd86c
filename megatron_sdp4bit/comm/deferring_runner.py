"""The runner for NCCL under one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``).

Every stream then feeds one hardware queue, where a wait for a hop still in flight
blocks the pass's kernels queued after it. So a staged job's stages are issued at
the caller's later calls instead of all at submission (``comm/runner.py`` has the
other runners and the ``StagedJob`` contract; docs/collectives.md, "One hardware
queue", says what this hides and what it does not).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional, Sequence

import torch

from megatron_sdp4bit.comm.layout import ONE_QUEUE_WHOLE_BUCKET_ELEMENTS
from megatron_sdp4bit.comm.runner import (Completion, Job, StagedJob, failed_before,
                                          record_completion, side_stream)


class DeferringRunner:
    """One hardware queue (NCCL with ``CUDA_DEVICE_MAX_CONNECTIONS=1``): a staged job's
    stages are issued at the caller's later calls, each once its hop has had a call's
    worth of the pass to finish.

    ``submit`` first gives every parked job its next stage, oldest first (a tail, then
    a body, whose waits are for hops issued one call ago), then runs the new job's
    head and parks its body. ``wait()`` on a handle, ``drain`` and ``close`` issue
    every stage left. Nothing is issued anywhere else, so every rank, calling in the
    same order, issues the same sequence; and the stages of neighbouring staged jobs
    keep the order the thread runner allows them (a job's tail before the next job's
    body, its body before the next job's head, its head before its body): the same
    buffers and rounding draws (``StagedJob``). A plain job runs whole at its
    submission, so it may come before the previous staged job's tail: the layer's
    plain jobs are its exact collectives, which use no workspace and no rounding
    stream, and a tail issues no collective, so neither the buffers nor any
    group's order of issue notice. On CUDA the stages run on a side stream, ordered
    after the caller's stream at submission; on the CPU, on the caller.

    A job's chunks would wait for one another's hops inside one call, so a collective
    of up to ``whole_bucket_elements`` elements (``ONE_QUEUE_WHOLE_BUCKET_ELEMENTS``)
    runs as one chunk, one slice: every wait of megatron's overlapped buckets is then for
    a hop issued at an earlier call. What it does not hide: a bucket above that (a
    whole pipeline stage's), or ``pipeline_chunks`` > 1, has chunks that wait in one call;
    and a bucket group of several buckets (megatron submits them in one call) waits for
    each bucket's first hop but the last's in that call: a job's body must run before
    the next job's head takes its buffers.
    """

    kind = "deferred"
    # Every stage is issued at a call of the caller's, in its order, and the weight gathers
    # one bucket group ahead as megatron issues its own: its groups may be the caller's.
    private_groups = False

    def __init__(self, device: torch.device,
                 whole_bucket_elements: Optional[int] = ONE_QUEUE_WHOLE_BUCKET_ELEMENTS) -> None:
        self.device = torch.device(device)
        self.whole_bucket_elements = whole_bucket_elements
        self.stream = side_stream(self.device) if self.device.type == "cuda" else None
        self._parked: "deque" = deque()  # (next stage, tensors, handle), oldest first
        self._failure: Optional[BaseException] = None

    def submit(self, job: Job, tensors: Sequence[torch.Tensor] = ()) -> Completion:
        if self._failure is not None:
            raise failed_before(self._failure)
        self._advance()
        handle = Completion(done=threading.Event(), device=self.device,
                            device_done=torch.cuda.Event() if self.stream is not None else None,
                            issue_rest=self.issue_all)
        head, body = (job.head, job.body) if isinstance(job, StagedJob) else (job, None)
        self._run(head, handle, after_caller=True)
        if body is None:
            self._complete(tensors, handle)
        else:
            self._parked.append((body, tuple(tensors), handle))
        return handle

    def issue_all(self) -> None:
        """Issue every parked stage (the rounds of ``_advance`` until none is left)."""
        while self._parked:
            self._advance()

    def drain(self) -> None:
        self.issue_all()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        """Issue what is left and join the host with it (``StreamRunner.close`` says why)."""
        self.drain()
        if self.stream is not None:
            self.stream.synchronize()

    def group_for(self, group):
        return group  # the caller issues everything, in its own order

    def _advance(self) -> None:
        """Every parked job's next stage, oldest first; a finished job is completed."""
        for _ in range(len(self._parked)):
            stage, tensors, handle = self._parked.popleft()
            after = self._run(stage, handle)
            if after is None:
                self._complete(tensors, handle)
                if self._failure is not None:  # completing it failed: issue nothing more
                    self._fail_parked(self._failure)
                    raise failed_before(self._failure)
            else:
                self._parked.append((after, tensors, handle))

    def _run(self, stage: Callable, handle: Completion, after_caller: bool = False):
        """``stage()`` on the side stream. If it raises, its job and every parked one
        fail (their handles raise), so does every later submission, and the error goes
        on to the caller: the collectives those jobs left in flight are in an unknown
        state."""
        try:
            with torch.no_grad():
                if self.stream is None:
                    return stage()
                if after_caller:  # a new job reads what the caller's stream has made
                    self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    return stage()
        except BaseException as error:
            self._failure = error
            handle.error = error
            handle._done.set()
            self._fail_parked(error)
            raise

    def _fail_parked(self, error: BaseException) -> None:
        for _stage, _tensors, parked in self._parked:
            parked.error = failed_before(error)
            parked._done.set()
        self._parked.clear()

    def _complete(self, tensors, handle: Completion) -> None:
        """The job's last stage is issued: its tensors and event recorded on the side
        stream, its waiter released. A failure here (a CUDA error) goes to the handle and
        fails every later call, as a stage's own does: no waiter is left hanging."""
        error = record_completion(self.stream, tensors, handle)
        if error is not None and self._failure is None:
            self._failure = error
