"""Worlds of gloo ranks on 127.0.0.1: the one way the tests start several processes.

``spawn_ranks(fn, world_size, *args)`` starts ``world_size`` processes, joins them
in a gloo group on a free port of 127.0.0.1, runs ``fn(rank, world_size, *args)``
in each and returns the results in rank order -- or raises ``RankFailed`` with the
failing rank's traceback, or ``TimeoutError`` (after killing the ranks) instead of
hanging. The ranks leave together, once every rank has reported: rank 0 hosts
the rendezvous store, which a slower rank may still be using. A world whose port
was taken between ``free_port`` and the rendezvous (another process on the
machine) is started again on a new port, up to twice.
``fn`` must be importable by name (a module-level function), and its result
picklable.

How the ranks start (``start``):

* ``"spawn"`` (default): fresh interpreters; nothing of the test process reaches
  a rank (megatron's parallel state is process-global), but each rank imports
  torch and megatron-core anew (seconds on a busy machine).
* ``"fork"``: copies of the test process, which inherit what it imported (the
  driver's tests import megatron-core once, before their worlds).
* ``"forkserver"``: forks of one server that imported torch and
  ``megatron_sdp4bit.comm`` and has run no torch op; cheap and clean, for many
  small worlds of collectives.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from megatron_sdp4bit.jobs import free_port

__all__ = ["RankFailed", "START_METHODS", "free_port", "spawn_ranks"]

START_METHODS = ("spawn", "fork", "forkserver")
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron_sdp4bit.comm"]
PORT_ATTEMPTS = 3


class RankFailed(RuntimeError):
    """A rank raised (or died); the message carries that rank's traceback."""


def _loopback_interface() -> Optional[str]:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def _join_world(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    import torch

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    loopback = _loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback  # keep gloo's pairs on 127.0.0.1
    torch.set_num_threads(1)  # world_size processes share a few cores
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable,
               args: tuple, results: Any, leave: Any) -> None:
    try:
        _join_world(rank, world_size, port, timeout_s)
        value = fn(rank, world_size, *args)
        # Plain pickle bytes: torch's multiprocessing pickler would hand tensors over as
        # shared-memory file descriptors, which die with this process.
        report = (rank, True, pickle.dumps(value))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        report = (rank, False, traceback.format_exc())
    results.put(report)
    # The ranks leave together: rank 0 hosts the rendezvous store, and a rank still
    # joining (or still using the store) would fail on its closed connection, and
    # report that instead of what it was about to say. The parent says when all have
    # reported (or kills the ranks when one failed).
    leave.wait(timeout_s)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _exit_now(results)


def _exit_now(results: Any) -> None:
    """End the rank once its report is in the pipe, without the interpreter's teardown:
    with torch loaded it takes seconds per process on a busy machine, and nothing is
    left to save. Processes the rank started (data workers, pools) end with it."""
    results.close()
    results.join_thread()
    for child in multiprocessing.active_children():
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context(start: str):
    if start not in START_METHODS:
        raise ValueError(f"start must be one of {START_METHODS}, got {start!r}")
    if start == "fork" and "fork" not in multiprocessing.get_all_start_methods():
        start = "spawn"  # no fork on this platform: slower, same result
    ctx = multiprocessing.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # used when the server first starts
    return ctx


def spawn_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 180.0,
                start: str = "spawn") -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results.

    Results come in rank order. If a rank raises, the others are killed and
    ``RankFailed`` carries its traceback; if the world does not finish within
    ``timeout_s`` seconds (which is also the process group's timeout),
    ``TimeoutError`` is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = _context(start)
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_world(ctx, fn, world_size, args, timeout_s)
        except RankFailed as failure:
            if "EADDRINUSE" not in str(failure) or attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _run_world(ctx, fn: Callable, world_size: int, args: tuple, timeout_s: float) -> List[Any]:
    results, leave = ctx.Queue(), ctx.Event()
    port = free_port()
    # Not daemonic, so a rank may start processes of its own (data workers, pools);
    # the finally clause below kills any rank still running.
    procs = [ctx.Process(target=_rank_main,
                         args=(rank, world_size, port, timeout_s, fn, args, results, leave))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    values: Dict[int, Any] = {}
    try:
        _collect(procs, results, values, fn, timeout_s)
        leave.set()
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(values) == world_size else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [values[rank] for rank in range(world_size)]


def _collect(procs: list, results: Any, values: Dict[int, Any], fn: Callable,
             timeout_s: float) -> None:
    """Read the ranks' reports into ``values`` until every rank has reported."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout_s
    while len(values) < world_size:
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"spawn_ranks: {world_size - len(values)} of {world_size} ranks did "
                    f"not finish {getattr(fn, '__name__', fn)} within {timeout_s:.0f}s") from None
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
            if dead:
                raise RankFailed(f"rank {dead[0]} died with exit code "
                                 f"{procs[dead[0]].exitcode} and no report") from None
            continue
        if not ok:
            raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
        values[rank] = pickle.loads(value)
