"""Wire accounting: what each collective sent, and what the exact one would have.

Every collective in ``megatron_sdp4bit.comm`` records, per call, the bytes that
left this rank, split by

- collective: ``all_gather`` (weights) or ``reduce_scatter`` (gradients);
- level: ``intra`` (to peers on this rank's physical node) or ``inter``
  (to peers on other nodes);
- kind: ``codes`` and ``scales`` (quantized payload), ``padding`` (the
  alignment gaps of a one-buffer message: every peer's segment starts on a
  16-byte boundary, at most 30 bytes per peer and message, see ``quant/wire.py``)
  or ``values`` (unquantized payload, from the exact paths);

plus the number of elements those bytes carry (padding included) and the
bytes the exact torch.distributed collective would have sent for the same
call (``exact``). Convention: a collective is counted as the direct sends it
implies, so an all-gather or reduce-scatter of shards of ``s`` elements sends
``(P - 1) * s`` elements per rank, split intra/inter by where each peer lives.
Bytes a rank keeps (its own chunk of an all-to-all) are not counted.

The counters live in a ``WireRecorder``. Each collective takes ``recorder=``:
the installed layer passes its own (``megatron/state.py``), so what a run reads
(``patch.wire_stats()``) is that layer's alone; direct callers that pass none
count into ``DEFAULT_RECORDER``, which ``get_wire_stats`` / ``reset_wire_stats``
read and zero. The layer's counters are never reset: they only grow, and each of
their readers takes its windows as differences (``WireStats.since``); only a
recorder's owner may reset it (``DEFAULT_RECORDER``: the direct callers, e.g. a
benchmark between its measurements).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

COLLECTIVES = ("all_gather", "reduce_scatter")
LEVELS = ("intra", "inter")
KINDS = ("codes", "scales", "padding", "values")
_FIELDS = KINDS + ("elements", "exact")


@dataclass(frozen=True)
class WireStats:
    """Snapshot of the byte counters. Every query sums over the arguments left as None."""

    counters: dict = field(default_factory=dict)  # (collective, level, field) -> int
    calls: dict = field(default_factory=dict)  # collective -> number of calls

    def _sum(self, names, collective, level) -> int:
        return sum(value for (c, lv, f), value in self.counters.items()
                   if f in names and collective in (None, c) and level in (None, lv))

    def sent_bytes(self, collective: Optional[str] = None, level: Optional[str] = None,
                   kind: Optional[str] = None) -> int:
        """Bytes that left this rank (codes + scales + padding + values unless ``kind`` says)."""
        return self._sum(KINDS if kind is None else (kind,), collective, level)

    def exact_bytes(self, collective: Optional[str] = None, level: Optional[str] = None) -> int:
        """Bytes the exact collective would have sent for the same calls."""
        return self._sum(("exact",), collective, level)

    def elements(self, collective: Optional[str] = None, level: Optional[str] = None) -> int:
        """Elements carried by ``sent_bytes`` (padding included)."""
        return self._sum(("elements",), collective, level)

    def bits_per_element(self, collective: Optional[str] = None,
                         level: Optional[str] = None) -> float:
        """Wire bits per element sent (4 + 32/G for 4-bit codes with group G)."""
        elements = self.elements(collective, level)
        return 8.0 * self.sent_bytes(collective, level) / elements if elements else 0.0

    def saving(self, collective: Optional[str] = None, level: Optional[str] = None) -> float:
        """exact bytes / sent bytes (how many times less went on the wire)."""
        sent = self.sent_bytes(collective, level)
        return self.exact_bytes(collective, level) / sent if sent else float("inf")

    def since(self, earlier: "WireStats") -> "WireStats":
        """What was counted after ``earlier``, an earlier snapshot of the same counters
        (they only grow, so a reader's window is the difference of two snapshots)."""
        counters = {key: value - earlier.counters.get(key, 0) for key, value in self.counters.items()}
        calls = {key: value - earlier.calls.get(key, 0) for key, value in self.calls.items()}
        if (any(value < 0 for value in (*counters.values(), *calls.values()))
                or set(earlier.counters) - set(self.counters) or set(earlier.calls) - set(self.calls)):
            raise ValueError("WireStats.since(earlier): earlier is not an earlier snapshot of these counters "
                             "(they only grow): take both from the same layer's patch.wire_stats()")
        return WireStats({key: value for key, value in counters.items() if value},
                         {key: value for key, value in calls.items() if value})

    def as_dict(self) -> dict:
        """Nested plain dict: {collective: {level: {field: int}}, 'calls': {...}}."""
        out: dict = {c: {lv: {f: 0 for f in _FIELDS} for lv in LEVELS} for c in COLLECTIVES}
        for (c, lv, f), value in self.counters.items():
            out[c][lv][f] = value
        out["calls"] = {c: self.calls.get(c, 0) for c in COLLECTIVES}
        return out

    def format(self) -> str:
        """A small text table, one row per collective and level."""
        rows = ["collective      level  calls      sent B     exact B  bits/elt  saving"]
        for c in COLLECTIVES:
            for lv in LEVELS:
                sent, exact = self.sent_bytes(c, lv), self.exact_bytes(c, lv)
                if not sent and not exact:
                    continue
                rows.append(f"{c:<15} {lv:<5} {self.calls.get(c, 0):>6} {sent:>11} {exact:>11}"
                            f" {self.bits_per_element(c, lv):>9.3f} {self.saving(c, lv):>6.2f}x")
        return "\n".join(rows)


class WireRecorder:
    """Counters of one owner's collectives; a lock keeps concurrent recorders consistent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict = defaultdict(int)
        self._calls: dict = defaultdict(int)

    def add(self, collective: str, level: str, **amounts: int) -> None:
        if collective not in COLLECTIVES or level not in LEVELS:
            raise ValueError(f"unknown collective/level {collective!r}/{level!r}")
        unknown = set(amounts) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown wire counters {sorted(unknown)}; use {_FIELDS}")
        with self._lock:
            for name, value in amounts.items():
                if value:
                    self._counters[(collective, level, name)] += int(value)

    def peer_sends(self, collective: str, intra_peers: int, inter_peers: int, **per_peer: int) -> None:
        """Record sending the same per-peer amounts to ``intra_peers`` + ``inter_peers`` peers."""
        for level, peers in (("intra", intra_peers), ("inter", inter_peers)):
            if peers:
                self.add(collective, level, **{k: v * peers for k, v in per_peer.items()})

    def call(self, collective: str) -> None:
        with self._lock:
            self._calls[collective] += 1

    def snapshot(self) -> WireStats:
        with self._lock:
            return WireStats(dict(self._counters), dict(self._calls))

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._calls.clear()


DEFAULT_RECORDER = WireRecorder()
"""Where collectives called without a ``recorder`` count (direct callers, benchmarks)."""


def recorder_or_default(recorder: Optional[WireRecorder]) -> WireRecorder:
    return DEFAULT_RECORDER if recorder is None else recorder


def get_wire_stats() -> WireStats:
    """Running totals of the collectives called without a recorder, since the last reset."""
    return DEFAULT_RECORDER.snapshot()


def reset_wire_stats() -> None:
    """Zero ``DEFAULT_RECORDER`` (e.g. at the start of a measured window)."""
    DEFAULT_RECORDER.reset()
