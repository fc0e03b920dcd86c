"""Host side of the kernels: tile sizes, grids, the views the kernels read, seeds.

Tile sizes trade registers against the number of programs. On a GPU a program
of ~4K elements keeps every value in registers and leaves enough programs to
fill the machine. Triton's CPU interpreter instead pays per program, so tests
raise ``tile_elements`` (``with tuning(tile_elements=1 << 16): ...``) and run a
whole small input in one or two programs.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional, Tuple

import torch


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass
class LaunchTuning:
    """How much work one program does.

    tile_elements: elements one program handles (a power of two >= 256): several
        whole groups per quantize program, that many outputs per dequantize program.
    max_group_block: the largest group a quantize program holds in registers at
        once (a power of two >= 256); larger groups are processed in slices of
        this many elements, read twice (absmax pass, then codes pass).
    """

    tile_elements: int = 4096
    max_group_block: int = 8192
    strips: bool = True
    """Use the quantize kernel's strip path where it applies (tests turn it off to
    check the generic path gives the same bits)."""

    def __post_init__(self) -> None:
        for name in ("tile_elements", "max_group_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 256 or value & (value - 1):
                raise ValueError(f"{name}={value!r} must be a power of two >= 256")


TUNING = LaunchTuning()


@contextlib.contextmanager
def tuning(**changes) -> Iterator[LaunchTuning]:
    """Temporarily change TUNING's fields, e.g. ``with tuning(tile_elements=1 << 16):``."""
    global TUNING
    previous = TUNING
    TUNING = dataclasses.replace(previous, **changes)
    try:
        yield TUNING
    finally:
        TUNING = previous


def exact_fp_options() -> dict:
    """Compile options that keep fp32 arithmetic exactly as written.

    - no FMA contraction: ``x * inv + 0.5`` and ``acc + code * scale`` must round
      twice, as the reference does;
    - no flush-to-zero in libdevice (Triton's default flushes subnormals in
      ``floor``: floor(-1e-39) would give -0 instead of -1).
    The second option only exists in recent Triton; older versions always flush
    there. That matters only for floor() of a subnormal, which nearest rounding
    never sees (|v + 0.5| is 0 or >= 2^-25) and stochastic rounding sees only when
    u is exactly 0.
    """
    options = {"enable_fp_fusion": False}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return options
    if "enable_reflect_ftz" in getattr(CUDAOptions, "__dataclass_fields__", {}):
        options["enable_reflect_ftz"] = False
    return options


def num_warps_for(tile: int) -> int:
    return 4 if tile <= 4096 else 8


def quantize_tiling(num_groups: int, group_size: int,
                    chunks: int = 1) -> Tuple[int, int, Tuple[int, int]]:
    """(BLOCK columns per pass, GROUPS_PER_PROGRAM, grid) for a quantize launch of
    ``chunks`` output chunks of ``num_groups`` groups each (grid axis 1: the chunk).

    BLOCK is at least 8: stochastic rounding draws noise for runs of 8 columns.
    """
    block = min(max(_next_pow2(group_size), 8), TUNING.max_group_block)
    if block < group_size:  # sliced groups: one group per program
        groups_per_program = 1
    else:
        groups_per_program = max(1, min(TUNING.tile_elements // block, _next_pow2(num_groups)))
    grid = (-(-num_groups // groups_per_program), chunks)
    return block, groups_per_program, grid


def quantize_strips(bits: int, group_size: int, hadamard_block: int, element_sizes=(),
                    source=None, codes_aligned: bool = True) -> bool:
    """Whether a quantize launch takes the strip path (quantize_kernel.py, strips.py):
    4- or 8-bit codes in 32-bit words (4-byte aligned), power-of-two groups of 32 or
    more held whole in a program, a Hadamard block of at most 32 (in a strip), 2- or
    4-byte float inputs (two or four 16-byte parts a strip), or received 4- or 8-bit
    codes, 4-byte aligned, in groups of whole strips (``source``: (bits, group size,
    aligned))."""
    if source is not None:
        source_bits, source_group, source_aligned = source
        if source_bits not in (4, 8) or source_group % 32 or not source_aligned:
            return False
    return (TUNING.strips and bits in (4, 8) and codes_aligned
            and 32 <= group_size <= TUNING.max_group_block
            and not group_size & (group_size - 1) and hadamard_block <= 32
            and all(size in (2, 4) for size in element_sizes))


def dequantize_strips(bits: int, group_size: int, hadamard_block: int, out_element_size: int,
                      codes_aligned: bool) -> bool:
    """Whether a dequantize launch takes the strip path (dequantize_kernel.py): 4- or
    8-bit codes in aligned 32-bit words, groups of whole strips of 32, a Hadamard
    block of at most 32, 2- or 4-byte outputs."""
    return (TUNING.strips and bits in (4, 8) and codes_aligned and group_size % 32 == 0
            and hadamard_block <= 32 and out_element_size in (2, 4))


def dequantize_tiling(numel: int, hadamard_block: int,
                      chunks: int = 1) -> Tuple[int, Tuple[int, int]]:
    """(BLOCK elements per program, grid) for a dequantize launch writing ``chunks``
    output chunks of ``numel`` elements each; BLOCK >= hadamard_block."""
    block = max(min(TUNING.tile_elements, _next_pow2(numel)), hadamard_block, 16)
    return block, (-(-numel // block), chunks)


# bf16 goes to the kernels as its int16 bit patterns (see tile_math); these dtypes
# are read and written natively.
NATIVE_FLOATS = (torch.float16, torch.float32, torch.float64)


def kernel_view(t: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """(tensor the kernel reads/writes, is_bf16) for a float tensor (contiguous rows)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    if t.dtype in NATIVE_FLOATS:
        return t, False
    raise ValueError(f"dtype {t.dtype} is not a float type the kernels read or write")


def flat_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and contiguous, in a dtype the kernels read.

    Non-contiguous inputs are copied (the reference accepts them too); non-float
    dtypes are converted to fp32 first, as the reference does.
    """
    flat = t.reshape(-1)
    if flat.dtype != torch.bfloat16 and flat.dtype not in NATIVE_FLOATS:
        flat = flat.to(torch.float32)
    return flat.contiguous()


def seed_tensor(generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """A one-element int64 tensor on ``device`` with a seed drawn from ``generator``.

    The draw advances the generator, so successive calls round differently and
    re-seeding the generator reproduces them. The seed stays a tensor so that
    on CUDA no host synchronisation is needed (the kernel loads it).
    """
    source_device = generator.device if generator is not None else device
    seed = torch.randint(2**31 - 1, (1,), generator=generator, device=source_device, dtype=torch.int64)
    return seed.to(device)


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s GPU even when another one is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
