"""Several hosts emulated on one machine: one torchrun "node" per host, each with its own identity.

    python -m megatron_sdp4bit.emulated_hosts --hosts 2 --ranks-per-host 2 -- -m megatron_sdp4bit.pretrain FLAGS

starts ``--hosts`` torchrun nodes of one job on this machine, meeting at 127.0.0.1 on
a free port. Host k's ranks see ``SDP4BIT_HOST_ID=emulated-host-k`` (the documented
override of ``comm/hosts.py``) and torchrun's ``LOCAL_WORLD_SIZE`` of one host, so
the layer learns the node layout from the hosts and cross-checks the launcher's
variable exactly as on a real multi-node job: no ``--sdp4bit-ranks-per-node``
needed. Nothing is slowed down and no root is needed (``benchmarks/emulated_nodes.py``
adds network namespaces and a slow link for the benchmark).

It waits for every node. When one exits with an error, the others are stopped (their
ranks would otherwise wait in a collective for the dead peers until a timeout) and
this command exits with the first error's status; Ctrl-C or SIGTERM stops them all.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from megatron_sdp4bit.comm.hosts import HOST_ID_VARIABLE
from megatron_sdp4bit.jobs import NodeRendezvous, free_port, job_env, torchrun_command

HOST_NAME = "emulated-host-{}"
# How long a stopped node's torchrun gets to end its ranks before SIGKILL: more than its
# own 30 s grace for them, or a rank stuck in a collective outlives a killed torchrun.
STOP_GRACE_S = 40.0


def node_commands(hosts: int, ranks_per_host: int, entry: Sequence[str], port: int,
                  python: str = sys.executable) -> List[tuple]:
    """``[(host identity, torchrun argv), ...]``: one node of the job per emulated host."""
    if hosts < 1 or ranks_per_host < 1:
        raise ValueError(f"--hosts {hosts} and --ranks-per-host {ranks_per_host} must both be >= 1")
    return [(HOST_NAME.format(node),
             torchrun_command(ranks_per_host, entry, python=python,
                              rendezvous=NodeRendezvous(hosts, node, "127.0.0.1", port)))
            for node in range(hosts)]


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()  # torchrun passes it on to its ranks
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _exit_status(returncode: int) -> int:
    """A shell's exit status: 128 + N for a node killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run(hosts: int, ranks_per_host: int, entry: Sequence[str], port: Optional[int] = None,
        poll_s: float = 0.2) -> int:
    """Start the nodes, wait for all; the first failing node's exit status (torchrun's:
    1 when a rank failed; the others stopped), else 0."""
    commands = node_commands(hosts, ranks_per_host, entry, port or free_port())
    procs: List[subprocess.Popen] = []

    def on_signal(signum, _frame):
        _stop(procs)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            for host, argv in commands:
                procs.append(subprocess.Popen(argv, env=job_env(**{HOST_ID_VARIABLE: host})))
        except BaseException:  # a node that cannot start: the started ones would wait for it
            _stop(procs)
            raise
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                _stop(procs)
                return _exit_status(failed[0])
            if all(code == 0 for code in codes):
                return 0
            time.sleep(poll_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="python -m megatron_sdp4bit.emulated_hosts --hosts N --ranks-per-host M -- ENTRY...")
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (torchrun nodes)")
    parser.add_argument("--ranks-per-host", type=int, default=2, help="ranks on each host")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("entry", nargs=argparse.REMAINDER,
                        help="after --: what each rank runs (-m module args... or script args...)")
    args = parser.parse_args(argv)
    entry = args.entry[1:] if args.entry[:1] == ["--"] else args.entry
    if not entry:
        parser.error("nothing to run: give the ranks' command after --, e.g. -- -m megatron_sdp4bit.pretrain")
    try:
        return run(args.hosts, args.ranks_per_host, entry, args.port)
    except ValueError as error:  # node_commands' one rule for the sizes, checked before any start
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
