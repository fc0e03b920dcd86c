"""Random streams for stochastic rounding: one per (rank, purpose, seed, device).

Each rank must draw different noise (identical noise on every rank would make
the rounding errors of a sum add up instead of averaging out), and a rerun with
the same seed must draw the same noise. A stream is created on first use from
``hash(seed, global rank, purpose)`` and then advances call after call, so the
n-th collective of a run always sees the same numbers.

The streams are a ``RoundingStreams`` object: the patch layer owns one in its state
(saved and restored with its checkpoints) and hands its generators to the
collectives; a caller of the collectives that passes no generator draws from
this module's default set, which ``reset_generators`` and friends manage.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Optional

import torch


def stream_seed(seed: int, global_rank: int, purpose: str) -> int:
    """A 63-bit seed that differs for every (seed, rank, purpose)."""
    blob = f"sdp4bit/{seed}/{global_rank}/{purpose}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


class RoundingStreams:
    """The generators of one owner, one per (device, seed, global rank, purpose)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generators: dict = {}

    def generator_for(self, device: torch.device, seed: int, global_rank: int,
                      purpose: str) -> torch.Generator:
        """The generator of this stream on ``device`` (created and seeded on first use)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (str(device), seed, global_rank, purpose)
        with self._lock:
            gen = self._generators.get(key)
            if gen is None:
                gen = torch.Generator(device=device)
                gen.manual_seed(stream_seed(seed, global_rank, purpose))
                self._generators[key] = gen
            return gen

    def reset(self) -> None:
        """Forget every stream: the next draw starts again from its seed."""
        with self._lock:
            self._generators.clear()

    def states(self) -> dict:
        """Every stream's state, for checkpoints (keys are picklable tuples)."""
        with self._lock:
            return {key: gen.get_state() for key, gen in self._generators.items()}

    def set_states(self, states: dict, seed: Optional[int] = None) -> None:
        """Restore the streams saved by ``states`` (others are forgotten), each on this
        process's device of the type it was saved on: a resume may put a rank on
        another GPU than the one that saved it (another launcher, another GPU count).
        Streams of a device type this process does not have (a GPU run resumed on a
        CPU) are dropped: they start again from their seed. ``seed``: the seed this
        process looks the streams up by, when it is not the one that drew them (a run
        resumed with another ``--sdp4bit-seed`` continues the checkpoint's streams; a
        stream already saved under ``seed`` is kept over one re-keyed to it)."""
        with self._lock:
            self._generators.clear()
            ordered = sorted(states.items(), key=lambda item: seed is not None and item[0][1] == seed)
            for (saved_device, saved_seed, *rest), state in ordered:  # under ``seed`` last: it wins
                device = device_here(saved_device)
                if device is None:
                    continue
                gen = torch.Generator(device=device)
                gen.set_state(state.to("cpu") if hasattr(state, "to") else state)
                self._generators[(str(device), saved_seed if seed is None else seed, *rest)] = gen


def device_here(saved_device: str) -> Optional[torch.device]:
    """This process's device of ``saved_device``'s type: a CUDA device becomes the
    current one, whatever index it had; None when there is no CUDA here."""
    device = torch.device(saved_device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


_DEFAULT_STREAMS = RoundingStreams()  # for callers of the collectives that pass no generator


def generator_for(device: torch.device, seed: int, global_rank: int,
                  purpose: str) -> torch.Generator:
    """The default set's generator of this stream (see ``RoundingStreams.generator_for``)."""
    return _DEFAULT_STREAMS.generator_for(device, seed, global_rank, purpose)


def pick_generator(explicit: Optional[torch.Generator], rounding: str, device: torch.device,
                   seed: int, global_rank: int, purpose: str) -> Optional[torch.Generator]:
    """The caller's generator if given, else this rank's default stream; None for nearest rounding."""
    if rounding != "stochastic":
        return None
    if explicit is not None:
        return explicit
    return generator_for(device, seed, global_rank, purpose)


def reset_generators() -> None:
    """Forget the default streams: the next collective starts again from its seed."""
    _DEFAULT_STREAMS.reset()


def generator_states() -> dict:
    """The default streams' states (keys are picklable tuples)."""
    return _DEFAULT_STREAMS.states()


def set_generator_states(states: dict) -> None:
    """Restore the default streams saved by ``generator_states``."""
    _DEFAULT_STREAMS.set_states(states)
