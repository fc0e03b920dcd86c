"""Two emulated "nodes" on one Linux host: network namespaces joined by a rate-limited veth.

Used by ``scripts/bench_slow_link.py`` (``benchmarks.slow_link``). Each node is a network namespace with
its own loopback and one end of a veth pair (addresses from a private /30 that
exists only inside the two namespaces, so nothing can reach any outside host:
the namespaces have no other interface and no default route). A token-bucket
filter (``tc ... tbf``) on each veth end limits each direction to the link rate.

Ranks of one node that talk to each other use their own node's address, which
the kernel routes through the namespace's loopback (fast, unlimited); ranks on
different nodes go through the veth (the slow "inter-node link").

Needs root and iproute2 (``ip``, ``tc``). ``EmulatedNodes`` is a context manager
that always removes what it created, also on errors and Ctrl-C; ``node_torchrun``
is the command that starts a node's ranks inside its namespace.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional, Sequence

from megatron_sdp4bit.jobs import NodeRendezvous, torchrun_command

NAMESPACES = ("sdp4bit-n0", "sdp4bit-n1")
VETHS = ("sdp4bit-v0", "sdp4bit-v1")     # interface names: at most 15 characters
ADDRESSES = ("10.77.0.1", "10.77.0.2")   # a /30 used only between the two namespaces
PREFIX_LEN = 30
TBF_QUEUE_LATENCY_MS = 50                # how long tbf may queue a packet before dropping it
LINUX_TICK_S = 0.004                     # one jiffy at HZ=250: tbf's burst must cover a tick
NUM_NODES = len(NAMESPACES)


class SetupError(RuntimeError):
    """The host cannot run emulated nodes (not root, no iproute2, namespaces refused)."""


def check_host() -> None:
    """Raise ``SetupError`` saying what to change unless this host can create the nodes."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        raise SetupError("emulated nodes need Linux network namespaces (this is not Linux)")
    if os.geteuid() != 0:
        raise SetupError("creating network namespaces and tc qdiscs needs root: rerun with sudo")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SetupError(f"{' and '.join(missing)} not found: install iproute2 "
                         "(apt-get install iproute2)")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SetupError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Bucket size for ``rate_mbit``: one timer tick's worth of bytes, at least 64 KiB.

    A smaller bucket cannot reach the configured rate (measured: 64 KiB gives
    915 of 1000 Mbit/s, 256 KiB 955); a much larger one lets bursts through.
    """
    return max(64 * 1024, int(rate_mbit * 1e6 / 8 * LINUX_TICK_S))


class EmulatedNodes:
    """Context manager: ``with EmulatedNodes() as nodes: nodes.set_link(100) ...``."""

    def __init__(self, delay_ms: float = 0.0):
        if delay_ms < 0:
            raise ValueError(f"delay_ms={delay_ms} must be >= 0")
        self.delay_ms = delay_ms
        self._created = False

    # --- life cycle -------------------------------------------------------------------

    def __enter__(self) -> "EmulatedNodes":
        check_host()
        self._remove_stale()
        self._created = True  # from here on, __exit__ removes whatever exists
        try:
            for ns in NAMESPACES:
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1])
            for ns, veth, addr in zip(NAMESPACES, VETHS, ADDRESSES):
                _sh("ip", "link", "set", veth, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", veth)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "link", "set", veth, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete both namespaces (which also deletes the veth pair inside them)."""
        if not self._created:
            return
        for ns in NAMESPACES:
            _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "link", "del", VETHS[0], check=False)  # only if the move into a namespace failed
        self._created = False

    @staticmethod
    def _remove_stale() -> None:
        """Remove namespaces this script left behind when it was killed (SIGKILL skips cleanup)."""
        existing = _sh("ip", "netns", "list").stdout.split()
        for ns in NAMESPACES:
            if ns in existing:
                print(f"removing namespace {ns} left over from an earlier run", flush=True)
                _sh("ip", "netns", "del", ns)
        if _sh("ip", "link", "show", VETHS[0], check=False).returncode == 0:
            _sh("ip", "link", "del", VETHS[0])

    # --- the link ---------------------------------------------------------------------

    def set_link(self, rate_mbit: Optional[float]) -> None:
        """Limit each direction of the veth to ``rate_mbit`` (None: no limit, veth speed)."""
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit={rate_mbit} must be positive (or None for no limit)")
        for ns, veth in zip(NAMESPACES, VETHS):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", veth, "root", check=False)
            tbf = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(tbf_burst_bytes(rate_mbit)),
                   "latency", f"{TBF_QUEUE_LATENCY_MS}ms"] if rate_mbit is not None else None
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth]
            try:
                if self.delay_ms > 0:
                    _sh(*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms:g}ms")
                    if tbf:
                        _sh(*tc, "parent", "1:", "handle", "10:", *tbf)
                elif tbf:
                    _sh(*tc, "root", *tbf)
            except SetupError as exc:
                kind = "netem (--delay-ms)" if self.delay_ms > 0 and "netem" in str(exc) else "tbf"
                raise SetupError(f"this kernel refused the {kind} qdisc: {exc}") from exc

    def set_slow_start_after_idle(self, value: str) -> None:
        """Both namespaces' ``net.ipv4.tcp_slow_start_after_idle`` (kernel default 1; 0 keeps
        TCP's window between a step's messages, as RDMA links have none)."""
        for ns in NAMESPACES:
            _sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                f"net.ipv4.tcp_slow_start_after_idle={value}")

    def describe_link(self) -> str:
        """The qdiscs now on node 0's veth end, as tc prints them."""
        return _sh("ip", "netns", "exec", NAMESPACES[0], "tc", "qdisc", "show", "dev",
                   VETHS[0]).stdout.strip()

    # --- running things in a node -----------------------------------------------------

    @staticmethod
    def exec_prefix(node: int) -> List[str]:
        """argv prefix that runs a command inside ``node``'s namespace."""
        return ["ip", "netns", "exec", NAMESPACES[node]]

    @staticmethod
    def tx_bytes(node: int) -> int:
        """Bytes ``node`` has sent over the veth so far (the kernel's interface counter)."""
        out = _sh("ip", "netns", "exec", NAMESPACES[node], "cat",
                  f"/sys/class/net/{VETHS[node]}/statistics/tx_bytes").stdout
        return int(out.strip())


def node_torchrun(node: int, port: int, nproc_per_node: int, entry: Sequence[str],
                  python: str) -> List[str]:
    """The argv that starts ``node``'s ``nproc_per_node`` ranks of a torchrun job of both
    nodes inside its namespace (rendezvous at node 0's address, ``port``), running
    ``entry``; gloo on the node's veth, one thread per rank. The namespaces share the
    machine's hostname, so ``SDP4BIT_HOST_ID`` names the emulated node its ranks are on."""
    env = [f"GLOO_SOCKET_IFNAME={VETHS[node]}", f"SDP4BIT_HOST_ID={NAMESPACES[node]}",
           "OMP_NUM_THREADS=1", "PYTHONWARNINGS=ignore"]
    rendezvous = NodeRendezvous(NUM_NODES, node, ADDRESSES[0], port)
    return [*EmulatedNodes.exec_prefix(node), "env", *env,
            *torchrun_command(nproc_per_node, entry, rendezvous=rendezvous, python=python)]
