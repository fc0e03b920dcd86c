"""SDP4BitConfig: the one configuration object every layer reads.

The argparse flags (``--sdp4bit-*``) map 1:1 onto these fields and the presets
(``sdp4bit``, ``zeropp``, ``qwd-only``, ``tlq-hs-only``, ``baseline``) are named
instances. Validation lives in ``__post_init__`` so a bad value fails where it is
made, with a message that says what to change.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_sdp4bit.quant.types import MAX_HADAMARD_BLOCK, SUPPORTED_BITS, codes_per_byte, is_hadamard_block

WEIGHT_MODES = ("diff", "direct", "off")
GRAD_MODES = ("tlq-hs", "tlq", "ulq", "off")
ROUNDINGS = ("stochastic", "nearest")
# Readable names for the paper's acronyms, accepted wherever a mode is given (flags, YAML,
# Python); the config keeps the acronym, so saved configs and fingerprints do not change.
MODE_ALIASES = {
    "weight_mode": {"weight-differences": "diff", "weights": "direct", "exact": "off"},
    "grad_mode": {"two-level-hadamard": "tlq-hs", "two-level": "tlq",
                  "two-level-uniform": "ulq", "exact": "off"},
}
EXACT_REDUCE_SCATTERS = ("native", "alltoall")
WEIGHT_GATHERS = ("two-level", "flat")
RUNNERS = ("auto", "inline", "thread", "stream", "deferred")


def _is_bool(value) -> bool:
    """bool is an int subclass; True is not a bit width or a group size."""
    return isinstance(value, bool)


class ConfigError(ValueError):
    """A field of ``SDP4BitConfig`` has a value it may not have.

    ``field`` names it, so a command-line front end can name its flag instead.
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


_BITS_IN_WORDS = f"{', '.join(map(str, SUPPORTED_BITS[:-1]))} or {SUPPORTED_BITS[-1]}"

ALLOWED = {
    "weight_mode": "one of " + ", ".join(f"{mode} ({alias})" for alias, mode in MODE_ALIASES["weight_mode"].items()),
    "grad_mode": "one of " + ", ".join(f"{mode} ({alias})" for alias, mode in MODE_ALIASES["grad_mode"].items()),
    "rounding": f"one of {', '.join(ROUNDINGS)}",
    "weight_bits": _BITS_IN_WORDS,
    "grad_bits_intra": _BITS_IN_WORDS,
    "grad_bits_inter": _BITS_IN_WORDS,
    "weight_group_size": "a positive multiple of 8 / weight_bits (codes fill whole bytes)",
    "grad_group_size_intra": "a positive multiple of 8 / its bits and, for tlq-hs, of hadamard_block",
    "grad_group_size_inter": "a positive multiple of 8 / its bits and, for tlq-hs, of hadamard_block",
    "hadamard_block": f"a power of two in 2..{MAX_HADAMARD_BLOCK}",
    "ranks_per_node": "an integer >= 1 (default: the ranks each host holds)",
    "pipeline_chunks": "an integer >= 1",
    "seed": "an integer >= 0",
    "grad_start_iter": "an integer >= 0",
    "check_interval": "an integer >= 0 (0 = never)",
    "exact_reduce_scatter": f"one of {', '.join(EXACT_REDUCE_SCATTERS)}",
    "weight_gather": f"one of {', '.join(WEIGHT_GATHERS)}",
    "runner": f"one of {', '.join(RUNNERS)}",
}
"""What each field may be, in words: for error messages and ``--help``. The rules
themselves are in ``SDP4BitConfig.__post_init__``."""


@dataclass(frozen=True)
class SDP4BitConfig:
    """How weights and gradients are compressed on the wire.

    Frozen: every value is checked once, when the config is made; a change is a new
    config (``replace``), checked again."""

    weight_mode: str = "diff"
    """Weight all-gather: ``diff`` = qWD (quantized weight differences, the paper's
    method), ``direct`` = qW (quantize the weights, ZeRO++ qwZ baseline), ``off`` =
    the exact all-gather."""

    weight_bits: int = 4
    """Bits per weight-difference code (2, 4 or 8)."""

    weight_group_size: int = 2048
    """Elements per fp32 scale for the weight quantizer (paper: 2048)."""

    grad_mode: str = "tlq-hs"
    """Gradient reduce-scatter: ``tlq-hs`` = two-level with Hadamard smoothing (the
    paper's method), ``tlq`` = two-level without Hadamard, ``ulq`` = two all-to-alls
    both at ``grad_bits_inter`` bits without Hadamard (ZeRO++ qgZ), ``off`` = the
    exact reduce-scatter."""

    grad_bits_intra: int = 8
    """Bits on the first (intra-node) all-to-all hop."""

    grad_bits_inter: int = 4
    """Bits on the second (inter-node) all-to-all hop; also both hops for ``ulq``."""

    grad_group_size_intra: int = 128
    """Elements per scale on the intra-node hop (multiple of ``hadamard_block``)."""

    grad_group_size_inter: int = 128
    """Elements per scale on the inter-node hop (multiple of ``hadamard_block``)."""

    hadamard_block: int = 32
    """Walsh-Hadamard block size for ``tlq-hs`` (power of two, 2..256)."""

    ranks_per_node: Optional[int] = None
    """Ranks that share a fast link. None = the ranks each host holds, learned from the
    hosts at install (``comm/hosts.py``). When given it must equal that number or divide
    it: a divisor emulates several nodes on one machine (e.g. 2 on 4 CPU ranks)."""

    pipeline_chunks: int = 1
    """Split each gradient bucket into this many chunks so the intra-node hop of
    chunk i+1 overlaps the inter-node hop of chunk i."""

    rounding: str = "stochastic"
    """``stochastic`` (unbiased, the paper's choice) or ``nearest``."""

    seed: int = 1234
    """Base seed of the stochastic-rounding generators (offset per rank)."""

    grad_start_iter: int = 0
    """Iteration from which gradients are quantized (exact before it)."""

    check_interval: int = 100
    """Every this many optimizer steps, check that all data-parallel replicas hold
    bit-identical weights (one small all-reduce and one host read; 0 = never)."""

    exact_reduce_scatter: str = "native"
    """How an unquantized gradient reduce-scatter runs (``grad_mode`` off, or before
    ``grad_start_iter``): ``native`` = the backend's own (NCCL's ring; gloo's is a ring
    all-reduce, twice the bytes), ``alltoall`` = one all-to-all plus a local fp32 sum
    (``comm/exact_alltoall.py``), a ring reduce-scatter's bytes on any backend: the
    like-for-like exact baseline on gloo (``scripts/bench_slow_link.py``'s
    ``baseline-a2a``). Needs the distributed optimizer."""

    weight_gather: str = "two-level"
    """How a quantized weight all-gather (qWD, qW) moves its segments where the nodes hold
    several ranks each: ``two-level`` = across nodes among the ranks of one local index,
    then inside the node (``comm/gather_hops.py``: (N-1)/N of the gather on each node's
    link), ``flat`` = one all-gather over the DP group (a ring: (P-1)/P of it). The
    weights come out bit-identical either way; one node, or one rank a node, is flat."""

    runner: str = "auto"
    """Where the collectives megatron overlaps (``--overlap-grad-reduce``,
    ``--overlap-param-gather``) run (``comm/runner.py``): ``auto`` = the one for the
    backend (a worker thread on gloo; a side stream on NCCL, or with
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` the deferring runner); ``inline`` = on the caller
    when megatron starts them, not overlapped (to rule the overlap out); ``thread``
    (gloo); ``stream`` (CUDA tensors, any backend: on gloo, one GPU can check NCCL's
    runner); ``deferred`` (any backend and device). ``inline``, ``thread`` and ``stream``
    give bit-identical results; ``deferred`` takes a bucket of up to 64 M elements in one
    chunk, so above ``MAX_CHUNK_ELEMENTS`` its stochastic rounding draws differ.
    Where a runner cannot run, the front ends refuse it (``megatron/background.py``)."""

    def __post_init__(self) -> None:
        """Every rule about a field lives here, and only here: a bad value fails where
        the config is made, with the field's name and what it may be."""
        for name, aliases in MODE_ALIASES.items():  # a readable name stands for its acronym
            value = getattr(self, name)
            if isinstance(value, str) and value in aliases:
                object.__setattr__(self, name, aliases[value])
        self._check_choice("weight_mode", WEIGHT_MODES)
        self._check_choice("grad_mode", GRAD_MODES)
        self._check_choice("rounding", ROUNDINGS)
        self._check_choice("exact_reduce_scatter", EXACT_REDUCE_SCATTERS)
        self._check_choice("weight_gather", WEIGHT_GATHERS)
        self._check_choice("runner", RUNNERS)
        for name in ("weight_bits", "grad_bits_intra", "grad_bits_inter"):
            value = getattr(self, name)
            if _is_bool(value) or value not in SUPPORTED_BITS:
                raise ConfigError(name, f"{name}={value!r} is not supported; use one of {SUPPORTED_BITS}")
        self._check_int("hadamard_block", minimum=2)
        if not is_hadamard_block(self.hadamard_block):
            raise ConfigError("hadamard_block", f"hadamard_block={self.hadamard_block!r} must be "
                              f"a power of two in 2..{MAX_HADAMARD_BLOCK} (2, 4, ..., {MAX_HADAMARD_BLOCK})")
        # Codes are packed several to a byte, so a group must fill whole bytes.
        for name, bits in (("weight_group_size", self.weight_bits),
                           ("grad_group_size_intra", self.effective_grad_bits_intra),
                           ("grad_group_size_inter", self.grad_bits_inter)):
            self._check_int(name, minimum=1)
            per_byte = codes_per_byte(bits)
            if getattr(self, name) % per_byte:
                raise ConfigError(name,
                    f"{name}={getattr(self, name)!r} must be a positive multiple of {per_byte} "
                    f"({per_byte} {bits}-bit codes share a byte), e.g. "
                    f"{max(per_byte, getattr(self, name) // per_byte * per_byte)}")
        if self.use_hadamard:
            for name in ("grad_group_size_intra", "grad_group_size_inter"):
                if getattr(self, name) % self.hadamard_block:
                    raise ConfigError(name,
                        f"{name}={getattr(self, name)} is not a multiple of "
                        f"hadamard_block={self.hadamard_block}; pick a group size that "
                        "is (e.g. 128 with block 32), or grad_mode='tlq' (no Hadamard)")
        if self.ranks_per_node is not None:
            self._check_int("ranks_per_node", minimum=1, hint=" or None (the ranks each host holds)")
        self._check_int("pipeline_chunks", minimum=1)
        self._check_int("seed", minimum=0)
        self._check_int("grad_start_iter", minimum=0)
        self._check_int("check_interval", minimum=0)

    def _check_choice(self, name: str, choices: tuple) -> None:
        if getattr(self, name) not in choices:
            aliases = MODE_ALIASES.get(name)
            also = f" (or {', '.join(aliases)})" if aliases else ""
            raise ConfigError(name, f"{name}={getattr(self, name)!r}; choose one of {choices}{also}")

    def _check_int(self, name: str, minimum: int, hint: str = "") -> None:
        value = getattr(self, name)
        if _is_bool(value) or not isinstance(value, int) or value < minimum:
            raise ConfigError(name, f"{name}={value!r} must be an integer >= {minimum}{hint}")

    # --- derived views ------------------------------------------------------------
    @property
    def quantize_weights(self) -> bool:
        return self.weight_mode != "off"

    @property
    def quantize_grads(self) -> bool:
        return self.grad_mode != "off"

    @property
    def use_hadamard(self) -> bool:
        return self.grad_mode == "tlq-hs"

    @property
    def effective_grad_bits_intra(self) -> int:
        """ULq uses the low bit width on both hops; the others use ``grad_bits_intra``."""
        return self.grad_bits_inter if self.grad_mode == "ulq" else self.grad_bits_intra

    @property
    def enabled(self) -> bool:
        return self.quantize_weights or self.quantize_grads

    @property
    def grad_hadamard_block(self) -> Optional[int]:
        """The Hadamard block the gradient hops use (TLq-HS), None without a transform."""
        return self.hadamard_block if self.use_hadamard else None

    def grad_hop_format(self, level: str) -> tuple:
        """(bits, group size) of a reduce-scatter hop: ``intra``-node hops at
        ``effective_grad_bits_intra``, ``inter``-node hops at ``grad_bits_inter``. A
        topology of one level uses the format of that level's kind."""
        if level == "intra":
            return self.effective_grad_bits_intra, self.grad_group_size_intra
        if level == "inter":
            return self.grad_bits_inter, self.grad_group_size_inter
        raise ValueError(f"level={level!r}; a hop is 'intra' or 'inter'")

    def grad_alignment(self, levels: Sequence[str]) -> int:
        """Elements a reduce-scatter chunk is a multiple of over hops ``levels``: every
        hop's group size and the Hadamard block (a block never straddles two groups)."""
        groups = [self.grad_hop_format(level)[1] for level in levels]
        return math.lcm(*groups, self.grad_hadamard_block or 1)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The configuration in words, for log lines (``to_dict`` has every field)."""
        weights = {"diff": f"{self.weight_bits}-bit weight differences (qWD)",
                   "direct": f"{self.weight_bits}-bit weights (qW)",
                   "off": "exact"}[self.weight_mode]
        hops = f"{self.grad_bits_intra}-bit intra-node, {self.grad_bits_inter}-bit inter-node"
        grads = {"tlq-hs": f"{hops} after a {self.hadamard_block}-point Hadamard rotation (TLq-HS)",
                 "tlq": f"{hops} (TLq)",
                 "ulq": f"{self.grad_bits_inter}-bit on both hops (ULq)",
                 "off": "exact"}[self.grad_mode]
        return f"weight all-gather {weights}; gradient reduce-scatter {grads}; {self.rounding} rounding"

    def fingerprint(self) -> int:
        """A stable 63-bit hash of every field, to check all ranks agree."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1

    def replace(self, **changes) -> "SDP4BitConfig":
        return dataclasses.replace(self, **changes)


PRESETS = {
    # The paper's method: qWD 4-bit g2048 + TLq-HS 8/4 g128 with Hadamard 32.
    "sdp4bit": SDP4BitConfig(),
    # ZeRO++ = qW (direct weight quantization) + ULq (4/4, no Hadamard).
    "zeropp": SDP4BitConfig(weight_mode="direct", grad_mode="ulq"),
    "qwd-only": SDP4BitConfig(grad_mode="off"),
    "tlq-hs-only": SDP4BitConfig(weight_mode="off"),
    "baseline": SDP4BitConfig(weight_mode="off", grad_mode="off"),
}


def preset(name: str, **overrides) -> SDP4BitConfig:
    """A named configuration, optionally with some fields changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
