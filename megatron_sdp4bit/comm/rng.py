"""Random streams for stochastic rounding: one per (rank, purpose, seed, device).

Each rank must draw different noise (identical noise on every rank would make
the rounding errors of a sum add up instead of averaging out), and a rerun with
the same seed must draw the same noise. A stream is created on first use from
``hash(seed, global rank, purpose)`` and then advances call after call, so the
n-th collective of a run always sees the same numbers.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Optional

import torch

_LOCK = threading.Lock()
_GENERATORS: dict = {}


def stream_seed(seed: int, global_rank: int, purpose: str) -> int:
    """A 63-bit seed that differs for every (seed, rank, purpose)."""
    blob = f"sdp4bit/{seed}/{global_rank}/{purpose}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


def generator_for(device: torch.device, seed: int, global_rank: int,
                  purpose: str) -> torch.Generator:
    """The cached generator of this stream on ``device`` (created and seeded on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), seed, global_rank, purpose)
    with _LOCK:
        gen = _GENERATORS.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(stream_seed(seed, global_rank, purpose))
            _GENERATORS[key] = gen
        return gen


def pick_generator(explicit: Optional[torch.Generator], rounding: str, device: torch.device,
                   seed: int, global_rank: int, purpose: str) -> Optional[torch.Generator]:
    """The caller's generator if given, else this rank's stream; None for nearest rounding."""
    if rounding != "stochastic":
        return None
    if explicit is not None:
        return explicit
    return generator_for(device, seed, global_rank, purpose)


def reset_generators() -> None:
    """Forget every stream: the next collective starts again from its seed."""
    with _LOCK:
        _GENERATORS.clear()


def generator_states() -> dict:
    """Every stream's state, for checkpoints (keys are picklable tuples)."""
    with _LOCK:
        return {key: gen.get_state() for key, gen in _GENERATORS.items()}


def set_generator_states(states: dict) -> None:
    """Restore the streams saved by ``generator_states`` (others are forgotten)."""
    with _LOCK:
        _GENERATORS.clear()
        for key, state in states.items():
            device = torch.device(key[0])
            gen = torch.Generator(device=device)
            gen.set_state(state.to("cpu") if hasattr(state, "to") else state)
            _GENERATORS[key] = gen
