"""Run a function on N real processes joined by gloo on 127.0.0.1, with a deadline.

``run_world(fn, world_size, *args)`` spawns the ranks, calls
``fn(rank, world_size, *args)`` in each, and returns the per-rank results in
rank order. A rank that raises fails the call with its traceback; a world that
does not finish in time (a deadlock) is terminated and fails too, so a bug
never hangs the test run. ``fn`` must be a module-level function.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0


def max_test_ranks() -> int:
    """Largest world the suite spawns (``SDP4BIT_TEST_MAX_RANKS``, default 8)."""
    return int(os.environ.get("SDP4BIT_TEST_MAX_RANKS", "8"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, fn, args, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share a couple of cores
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=90),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Flush the result, then skip the interpreter's teardown: with torch loaded it
        # takes seconds per process on a busy machine, and there is nothing left to save.
        results.close()
        results.join_thread()
        os._exit(0)


def _context():
    """A forkserver that imports torch once; every rank of every world forks from it.

    Fresh interpreters (spawn) would import torch per rank, seconds each on a
    busy machine; the server has run no torch op, so forking it is safe.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "megatron_sdp4bit.comm"])
    return ctx


def run_world(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]`` computed on real ranks."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(rank, world_size, port, fn, args, results),
                         daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    collected: dict = {}
    failure = None
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failure = (f"world of {world_size} ranks did not finish in {timeout:.0f} s "
                           f"(deadlock?); finished ranks: {sorted(collected)}")
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    failure = f"a rank died with exit codes {dead} before reporting"
                continue
            if ok:
                collected[rank] = value
            else:
                failure = f"rank {rank} failed:\n{value}"
    finally:
        for proc in procs:
            proc.join(timeout=5 if failure is None else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    if failure is not None:
        raise AssertionError(failure)
    return [collected[rank] for rank in range(world_size)]
