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
    """Codes and per-group scales of a flat tensor, whole or as k chunks.

    ``codes`` is uint8 with ``codes_per_byte(bits)`` codes per byte for 2 and 4
    bits (element 2i in the low nibble for 4-bit), int8 (or uint8 bytes) for 8
    bits. ``scales`` is fp32, one per group. ``numel`` is the true length, and
    ``dtype`` the dtype ``dequantize`` returns by default (the input's).

    Two forms:

    - flat (``codes`` and ``scales`` 1-D, contiguous): one tensor; its last group
      is zero-padded up to ``group_size``. A flat tensor of k*n elements whose n
      is a multiple of ``group_size`` is also k concatenated tensors of n
      elements (``num_chunks`` of the ops that sum chunks);
    - k-chunk (``codes`` [k, codes bytes of a chunk], ``scales`` [k, groups of a
      chunk], each row contiguous, any row stride): k tensors of ``numel // k``
      elements, chunk c in row c, each padded to whole groups on its own. The
      rows may be views of one wire buffer (``wire.py``: row stride = segment).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    numel: int
    dtype: torch.dtype = torch.float32

    @property
    def num_chunks(self) -> int:
        """k of the k-chunk form; 1 for the flat form."""
        return self.codes.shape[0] if self.codes.dim() == 2 else 1

    @property
    def chunk_numel(self) -> int:
        """Elements of one chunk (``numel`` for the flat form)."""
        return self.numel // self.num_chunks

    @property
    def padded_numel(self) -> int:
        """Elements including every chunk's zero padding."""
        return self.num_chunks * num_groups(self.chunk_numel, self.group_size) * self.group_size

    @property
    def num_groups(self) -> int:
        return self.num_chunks * num_groups(self.chunk_numel, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales (what travels, without a wire buffer's alignment gaps)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def chunk(self, c: int) -> "QuantizedTensor":
        """Chunk c of the k-chunk form as a flat tensor (views, no copy)."""
        if self.codes.dim() != 2:
            raise ValueError("chunk(c) needs the k-chunk form (2-D codes and scales)")
        return QuantizedTensor(self.codes[c], self.scales[c], self.bits, self.group_size,
                               self.chunk_numel, self.dtype)

    @staticmethod
    def codes_nbytes(numel: int, bits: int, group_size: int) -> int:
        return num_groups(numel, group_size) * group_size // codes_per_byte(bits)


def check_quantized(q, what: str = "the quantized tensor") -> None:
    """``q``'s codes and scales have one of the two layouts QuantizedTensor documents."""
    if not isinstance(q, QuantizedTensor):
        raise ValueError(f"{what} must be a QuantizedTensor, got {type(q).__name__}")
    check_group_size(q.group_size, q.bits)
    codes, scales = q.codes, q.scales
    if codes.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"{what}: codes must be uint8 (or int8) bytes, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"{what}: scales must be fp32, got {scales.dtype}")
    if codes.device != scales.device:
        raise ValueError(f"{what}: codes are on {codes.device} but scales on {scales.device}")
    if codes.dim() != scales.dim() or codes.dim() not in (1, 2):
        raise ValueError(f"{what}: codes and scales must both be 1-D (flat) or both 2-D "
                         f"(k chunks), got {codes.dim()}-D and {scales.dim()}-D")
    k = q.num_chunks
    if k == 0 or q.numel < 0 or q.numel % k:
        raise ValueError(f"{what}: {q.numel} elements cannot be {k} equal chunks")
    n = q.numel // k
    expected = (k, QuantizedTensor.codes_nbytes(n, q.bits, q.group_size), num_groups(n, q.group_size))
    shapes = (tuple(codes.shape), tuple(scales.shape))
    if codes.dim() == 1:
        want = ((expected[1],), (expected[2],))
        contiguous = codes.is_contiguous() and scales.is_contiguous()
    else:
        want = ((k, expected[1]), (k, expected[2]))
        contiguous = (codes.shape[1] < 2 or codes.stride(1) == 1) and (
            scales.shape[1] < 2 or scales.stride(1) == 1)
    if shapes != want:
        raise ValueError(
            f"{what}: codes {list(codes.shape)} and scales {list(scales.shape)} do not hold "
            f"{k} chunk(s) of {n} {q.bits}-bit elements in groups of {q.group_size}: expected "
            f"codes {list(want[0])} and scales {list(want[1])}")
    if not contiguous:
        raise ValueError(f"{what}: codes and scales must be contiguous (each row, for the "
                         "k-chunk form); call .contiguous() on them")


def check_out(out, numel: int, bits: int, group_size: int, device: torch.device) -> None:
    """A preallocated ``out`` for a producer of ``numel`` elements in this format."""
    check_quantized(out, "out")
    if (out.bits, out.group_size) != (bits, group_size):
        raise ValueError(f"out holds {out.bits}-bit codes in groups of {out.group_size}, but "
                         f"this call makes {bits}-bit codes in groups of {group_size}")
    if out.numel != numel:
        raise ValueError(f"out holds {out.numel} elements, this call makes {numel}")
    if out.codes.device != device:
        raise ValueError(f"out is on {out.codes.device}, the input on {device}")


def check_whole_groups(numel: int, num_chunks: int, group_size: int, what: str) -> int:
    """Elements per chunk of ``num_chunks`` equal chunks, each of whole groups."""
    if not isinstance(num_chunks, int) or num_chunks <= 0 or numel % num_chunks:
        raise ValueError(f"{numel} elements cannot be split into {num_chunks} equal chunks")
    chunk = numel // num_chunks
    if chunk % group_size:
        raise ValueError(
            f"chunk of {chunk} elements is not a multiple of group_size={group_size}; "
            f"{what} must start on a group boundary"
        )
    return chunk


def chunks_to_sum(q: QuantizedTensor, num_chunks: int) -> int:
    """Elements per chunk when ``dequantize_sum*`` sums ``num_chunks`` chunks of ``q``.

    Flat ``q``: ``num_chunks`` concatenated chunks; k-chunk ``q``: its k rows
    (``num_chunks`` must be k). Either way every chunk is whole groups.
    """
    if q.codes.dim() == 2 and num_chunks != q.num_chunks:
        raise ValueError(f"num_chunks={num_chunks} but the quantized tensor holds "
                         f"{q.num_chunks} chunks (rows)")
    return check_whole_groups(q.numel, num_chunks, q.group_size, "chunks")


def check_hadamard_chunks(chunk_numel: int, group_size: int, block) -> None:
    """A Hadamard block (or None) for chunks of ``chunk_numel`` elements in groups of ``group_size``."""
    if block is None:
        return
    check_hadamard_group(group_size, block)
    if chunk_numel % block:
        raise ValueError(
            f"{chunk_numel} elements is not a multiple of the Hadamard block {block}")


def check_out_chunks_whole(out: QuantizedTensor, *group_sizes: int) -> None:
    """Ops whose output chunks must hold whole groups (of every format involved)."""
    for size in group_sizes:
        if out.num_chunks > 1 and out.chunk_numel % size:
            raise ValueError(
                f"out's chunks of {out.chunk_numel} elements are not whole groups of {size}; "
                "use chunks of whole groups (or a flat out)")


def check_rows(rows: torch.Tensor, order, start: int, valid: int, padded: int,
               group_size: int, block) -> None:
    """The arguments of ``hadamard_quantize_rows`` (see its docstring)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError("rows must be a 2-D tensor [P, shard] (the input viewed as P shards)")
    if not rows.is_floating_point():
        raise ValueError(f"rows must be a float tensor, got {rows.dtype}")
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError("rows must be contiguous along each row (stride 1): pass input.view(P, shard)")
    for name, value in (("start", start), ("valid", valid), ("padded", padded)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r} must be a non-negative integer")
    if valid > padded or start + valid > rows.shape[1]:
        raise ValueError(f"columns [{start}, {start + valid}) padded to {padded} do not fit rows "
                         f"of {rows.shape[1]}: need valid <= padded and start + valid <= shard")
    if padded % group_size:
        raise ValueError(f"padded={padded} must be a multiple of group_size={group_size}")
    check_hadamard_chunks(padded, group_size, block)
    if order is not None:
        if (not isinstance(order, torch.Tensor) or order.dim() != 1
                or order.numel() != rows.shape[0] or order.is_floating_point()
                or order.dtype == torch.bool):
            raise ValueError(f"order must be None or a 1-D integer tensor of the {rows.shape[0]} "
                             "row indices in send order")
        if order.device != rows.device:
            raise ValueError(f"order is on {order.device}, rows on {rows.device}")
