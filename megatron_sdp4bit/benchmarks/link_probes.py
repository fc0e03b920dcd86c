"""Probes of the emulated nodes (``emulated_nodes``) that give the estimator its inputs.

Used by ``scripts/bench_slow_link.py`` (``benchmarks.slow_link``):

- ``probe_goodput``: Gbit/s of one TCP stream between two nodes (or within one,
  over its loopback), the estimator's ``--inter-gbps`` / ``--intra-gbps``;
- ``probe_latency``: microseconds one small message takes one way (half the
  median round trip of a 1-byte ping-pong), the estimator's per-message latency;
- ``probe_cpu``: cores one rank gets now (as many busy processes as ranks).

Each probe runs its two ends in the namespaces with ``ip netns exec`` and talks
only to the namespaces' private addresses.
"""
from __future__ import annotations

import statistics
import subprocess
from typing import Optional

from megatron_sdp4bit.benchmarks.emulated_nodes import ADDRESSES, EmulatedNodes

PROBE_PORT = 29590

_GOODPUT_SERVER = """import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if t0 is None: t0 = time.perf_counter()
    if not b: break
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
_GOODPUT_CLIENT = """import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); block = bytes(1 << 20)
left = int(sys.argv[3])
while left > 0:
    c.sendall(block[:min(left, len(block))]); left -= len(block)
c.close()
"""
_ECHO_SERVER = """import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(1)
    if not b: break
    c.sendall(b)
"""
_PING_CLIENT = """import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtt.append(time.perf_counter() - t0)
c.close()
print(statistics.median(rtt) / 2 * 1e6, flush=True)
"""


def _serve(node: int, script: str, python: str) -> subprocess.Popen:
    server = subprocess.Popen([*EmulatedNodes.exec_prefix(node), python, "-c", script,
                               ADDRESSES[node], str(PROBE_PORT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if server.stdout.readline().strip() != "ready":
        server.kill()
        raise RuntimeError(f"link probe server did not start: {server.stderr.read()[-500:]}")
    return server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.kill()
    server.wait()


def probe_goodput(python: str, src: int, dst: int, nbytes: int) -> float:
    """Gbit/s of one TCP stream from node ``src`` to node ``dst`` (same node: its loopback),
    timed at the receiver from the first byte to the end."""
    server = _serve(dst, _GOODPUT_SERVER, python)
    try:
        subprocess.run([*EmulatedNodes.exec_prefix(src), python, "-c", _GOODPUT_CLIENT,
                        ADDRESSES[dst], str(PROBE_PORT), str(nbytes)], check=True, timeout=120)
        received, seconds = server.stdout.readline().split()
        return int(received) * 8 / float(seconds) / 1e9
    finally:
        _stop(server)


def probe_latency(python: str, src: int, dst: int, round_trips: int = 200) -> float:
    """Microseconds one 1-byte message takes one way from ``src`` to ``dst`` (half the
    median round trip of a ping-pong with Nagle off; same node: over its loopback)."""
    server = _serve(dst, _ECHO_SERVER, python)
    try:
        out = subprocess.run([*EmulatedNodes.exec_prefix(src), python, "-c", _PING_CLIENT,
                              ADDRESSES[dst], str(PROBE_PORT), str(round_trips)],
                             check=True, timeout=120, capture_output=True, text=True).stdout
        return float(out.strip())
    finally:
        _stop(server)


_CPU_PROBE = """import time
wall, cpu = time.perf_counter(), time.process_time()
while time.process_time() - cpu < 0.4:
    sum(range(1000))
print((time.process_time() - cpu) / (time.perf_counter() - wall), flush=True)
"""


def probe_cpu(python: str, num_nodes: int, ranks_per_node: int) -> float:
    """Cores one rank gets now: as many busy processes as ranks (each node's in its namespace,
    in this session like the ranks), CPU seconds / wall seconds, median over them."""
    procs = [subprocess.Popen([*EmulatedNodes.exec_prefix(node), python, "-c", _CPU_PROBE],
                              stdout=subprocess.PIPE, text=True)
             for node in range(num_nodes) for _ in range(ranks_per_node)]
    return statistics.median(float(p.communicate(timeout=120)[0]) for p in procs)


def probe_bytes(rate: Optional[float]) -> int:
    """About two seconds at the rate (256 MiB without a limit)."""
    return 256 * 2**20 if rate is None else int(rate * 1e6 / 8 * 2)
