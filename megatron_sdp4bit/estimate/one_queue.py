"""What the runner for one hardware queue leaves exposed, hop by hop (pure arithmetic).

Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream feeds one hardware queue, and a wait
for a hop still in flight holds up the pass's kernels queued behind it. So the layer's
``comm/deferring_runner.py`` issues a collective's stages at megatron's later calls:
at bucket i's start, bucket i - 2's tail, bucket i - 1's body, then bucket i's head;
the first wait issues what is left, one stage per parked job in each round, oldest first.
The stages are those of ``comm/gradients.py`` and ``comm/weights.py``:

- reduce-scatter: the head quantizes chunk 0 and starts its first hop; the body runs
  every other chunk up to the last chunk's last hop in flight, waiting inside the call
  (two levels: each chunk's first hop, before requantizing it for the second; each
  chunk's second hop, before the slot is reused); the tail (two levels) waits for the
  last second hop. One level has no tail: its body waits for the last hop.
- weight gather: megatron starts bucket k + 1's at bucket k's forward pre-hook, just
  after waiting for bucket k's (the first at its own pre-hook). The head starts slice
  0's first hop; the pre-hook's wait issues the rest: every other slice, each slice's
  second hop after its first, and waits for all of it.

Each hop level runs on its group's NCCL stream, one hop after another; a hop starts when
issued and when that stream is free. A wait at the pass's time ``now`` moves ``now`` to
the hop's end: the pass stops. A bucket's hops take its share of the direction's
seconds, split evenly over its chunks (slices). The kernels are priced apart: in one queue
a hop's NCCL call waits for the kernel before it, so they add to the step
(``timing.py``).
"""
from __future__ import annotations

from typing import List, Optional


class _Streams:
    """One NCCL stream per hop level: when each is free."""

    def __init__(self, levels: int):
        self.free = [0.0] * levels

    def run(self, level: int, issued: float, seconds: float) -> float:
        """A hop of ``level`` issued at ``issued``: when it is done."""
        self.free[level] = max(issued, self.free[level]) + seconds
        return self.free[level]


class _ReduceScatter:
    """One bucket's reduce-scatter: its stages, each run at the pass's time."""

    def __init__(self, streams: _Streams, chunk_hops: List[float], chunks: int):
        self.streams, self.hops, self.chunks = streams, chunk_hops, chunks
        self.first: List[float] = []   # when each chunk's first hop is done
        self.second: List[float] = []  # and its second (two levels)

    @property
    def stages(self) -> int:
        return 3 if len(self.hops) == 2 else 2

    def stage(self, index: int, now: float) -> float:
        """Run stage ``index`` (head, body, tail) at ``now``; return the pass's time after it."""
        if index == 0:
            self._first_hop(now)
            return now
        if index == 2:
            return max(now, self.second[-1])
        for chunk in range(1, self.chunks):
            self._first_hop(now)
            now = self._on_to_last_hop(chunk - 1, now)
        return self._on_to_last_hop(self.chunks - 1, now)

    def _first_hop(self, now: float) -> None:
        self.first.append(self.streams.run(0, now, self.hops[0]))

    def _on_to_last_hop(self, chunk: int, now: float) -> float:
        """Chunk ``chunk`` past its first hop: one level, written (waited for); two, its
        second hop started and the chunk before it written."""
        now = max(now, self.first[chunk])
        if len(self.hops) == 1:
            return now
        self.second.append(self.streams.run(1, now, self.hops[1]))
        return max(now, self.second[chunk - 1]) if chunk else now


def reduce_scatter_exposed(hops: List[float], backward: float, shares: List[float],
                           chunks: Optional[List[int]] = None) -> float:
    """What the reduce-scatters add to the ``backward`` pass: ``hops`` are each hop
    level's seconds over all buckets, ``shares`` each bucket's share of them and of the
    pass in megatron's order (the first is reduced first), ``chunks`` each bucket's
    chunks (default one: a bucket taken whole)."""
    if not hops:
        return 0.0
    streams = _Streams(len(hops))
    chunks = chunks or [1] * len(shares)
    jobs = [_ReduceScatter(streams, [h * share / k for h in hops], k)
            for share, k in zip(shares, chunks)]
    parked: List[list] = []  # [job, next stage], oldest first
    now = 0.0
    for job, share in zip(jobs, shares):
        now += backward * share          # the pass makes the bucket ready: megatron starts it
        now = _advance(parked, now)
        now = job.stage(0, now)
        parked.append([job, 1])
    while parked:                        # finish_grad_sync's first wait issues the rest
        now = _advance(parked, now)
    return now - backward


def _advance(parked: List[list], now: float) -> float:
    """Every parked job's next stage, oldest first; a finished job leaves."""
    for entry in list(parked):
        job, stage = entry
        now = job.stage(stage, now)
        entry[1] += 1
        if entry[1] == job.stages:
            parked.remove(entry)
    return now


def gather_exposed(hops: List[float], forward: float, shares: List[float],
                   slices: Optional[List[int]] = None) -> float:
    """What the weight gathers add to the ``forward`` pass: ``hops`` (one level: the ring;
    two: across nodes, then inside the node) as ``reduce_scatter_exposed``'s, ``shares``
    and ``slices`` per bucket in megatron's order (the forward pass needs the last
    first)."""
    if not hops:
        return 0.0
    streams = _Streams(len(hops))
    order = list(zip(shares, slices or [1] * len(shares)))[::-1]
    slice_hops = [[h * share / count for h in hops] for share, count in order]
    now = 0.0
    started = streams.run(0, now, slice_hops[0][0])  # the first bucket, at its own pre-hook
    for k, (share, count) in enumerate(order):
        first = [started]  # when each slice's first hop is done
        for index in range(1, count):    # the pre-hook's wait: every other slice, in the call
            first.append(streams.run(0, now, slice_hops[k][0]))
            now = _apply(streams, slice_hops[k], first[index - 1], now)
        now = _apply(streams, slice_hops[k], first[-1], now)
        if k + 1 < len(order):           # the pre-hook starts the next bucket's gather
            started = streams.run(0, now, slice_hops[k + 1][0])
        now += forward * share
    return now - forward


def _apply(streams: _Streams, slice_hops: List[float], first_done: float, now: float) -> float:
    """A slice applied at ``now``: wait for its first hop, run its second, wait for that."""
    now = max(now, first_done)
    if len(slice_hops) == 2:
        now = streams.run(1, now, slice_hops[1])
    return now
