"""The quantized-tensor container and the argument checks every backend shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The wire format's rules, defined here once: SDP4BitConfig checks its fields with
# them (naming the field), the quantizer functions check their arguments with them.
SUPPORTED_BITS = (2, 4, 8)
MAX_HADAMARD_BLOCK = 256  # the kernels' largest in-register butterfly


def is_hadamard_block(block) -> bool:
    """A power of two in 2..MAX_HADAMARD_BLOCK."""
    return (isinstance(block, int) and not isinstance(block, bool)
            and 2 <= block <= MAX_HADAMARD_BLOCK and not block & (block - 1))


def codes_per_byte(bits: int) -> int:
    """How many codes share one byte on the wire: 4-bit two, 2-bit four, 8-bit one."""
    return 8 // bits


def qmax(bits: int) -> int:
    """Largest code magnitude used by the scale: 2^(b-1) - 1 (7 for 4-bit)."""
    return (1 << (bits - 1)) - 1


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")


def check_group_size(group_size: int, bits: int) -> None:
    check_bits(bits)
    width = codes_per_byte(bits)
    if not isinstance(group_size, int) or group_size <= 0 or group_size % width:
        raise ValueError(
            f"group_size={group_size!r} must be a positive multiple of {width} "
            f"(the number of {bits}-bit codes packed in one byte)"
        )


def check_rounding(rounding: str) -> None:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r}; use 'nearest' or 'stochastic'")


def check_format(bits: int, group_size: int, rounding: str) -> None:
    """The quantizer arguments every op takes (shared by both backends)."""
    check_group_size(group_size, bits)
    check_rounding(rounding)


def check_same_numel(name: str, tensor: torch.Tensor, other_name: str, numel: int) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements but {other_name} {numel}")


def check_hadamard_block(block: int) -> None:
    if not is_hadamard_block(block):
        raise ValueError(
            f"hadamard block={block!r} must be a power of two between 2 and {MAX_HADAMARD_BLOCK}"
        )


def check_hadamard_group(group_size: int, block: int) -> None:
    check_hadamard_block(block)
    if group_size % block:
        raise ValueError(
            f"group_size={group_size} is not a multiple of the Hadamard block {block}; "
            "choose a group size that is (e.g. 128 for block 32)"
        )


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


@dataclass
class QuantizedTensor:
    """Codes and per-group scales of a flat tensor.

    ``codes`` is uint8 with ``codes_per_byte(bits)`` codes per byte for 2 and 4
    bits (element 2i in the low nibble for 4-bit), int8 for 8 bits. ``scales`` is
    fp32, one per group. The last group is padded with zeros up to ``group_size``;
    ``numel`` is the true length, and ``dtype`` the input's dtype.

    A tensor of k*n elements whose n is a multiple of ``group_size`` is also k
    concatenated quantized tensors of n elements: that is how received
    all-to-all buffers are read (``dequantize_sum`` and friends take ``num_chunks``).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    numel: int
    dtype: torch.dtype = torch.float32

    @property
    def padded_numel(self) -> int:
        return num_groups(self.numel, self.group_size) * self.group_size

    @property
    def num_groups(self) -> int:
        return num_groups(self.numel, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes this tensor occupies on the wire (codes + scales)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @staticmethod
    def codes_nbytes(numel: int, bits: int, group_size: int) -> int:
        return num_groups(numel, group_size) * group_size // codes_per_byte(bits)
