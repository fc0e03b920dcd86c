"""Compile every kernel variant for an NVIDIA architecture, no GPU needed.

Triton's front end, LLVM and ptxas all run on the CPU, so this catches what the
CPU interpreter cannot: code that the interpreter runs (it executes Python and
numpy) but the compiler rejects, and unwanted instructions in the PTX (fused
multiply-adds, flush-to-zero, approximate division), which would break bit
equality with the reference.

    python -m megatron_sdp4bit.quant.triton_kernels.compile_check [--arch 90]

Must run without TRITON_INTERPRET=1 (the kernels must be JIT functions).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Dict, List, Tuple

import triton

from megatron_sdp4bit.quant.triton_kernels import launch
from megatron_sdp4bit.quant.triton_kernels.dequantize_kernel import dequantize_kernel
from megatron_sdp4bit.quant.triton_kernels.quantize_kernel import (
    SOURCE_CHUNKS,
    SOURCE_TENSOR,
    quantize_kernel,
)

# Runtime arguments typed as triton_ops passes them: bf16 through an int16 view,
# packed codes as uint8, 8-bit codes as int8, Python ints as i32, floats as fp32.
_QUANTIZE_ARGS = dict(
    x_ptr="*fp32", y_ptr="*fp32", multiplier="fp32",
    src_codes_ptr="*u8", src_scales_ptr="*fp32", num_chunks="i32", chunk_numel="i32",
    codes_ptr="*u8", scales_ptr="*fp32", seed_ptr="*i64", numel="i32", num_groups="i32",
)
_QUANTIZE_DEFAULTS = dict(
    SOURCE=SOURCE_TENSOR, X_BF16=False, HAS_Y=False, Y_BF16=False, SCALED=False, TAIL=False,
    SRC_BITS=8, SRC_GROUP=1,
    BITS=4, GROUP=128, GROUPS_PER_PROGRAM=32, BLOCK=128, HADAMARD=0, STOCHASTIC=False,
)
_DEQUANTIZE_ARGS = dict(
    codes_ptr="*u8", scales_ptr="*fp32", out_ptr="*fp32",
    numel="i32", num_chunks="i32", chunk_numel="i32",
)
_DEQUANTIZE_DEFAULTS = dict(BITS=4, GROUP=128, BLOCK=4096, HADAMARD=0, OUT_BF16=False,
                            ACCUMULATE=False)

# (name, kernel, argument types overridden, constexprs overridden): every branch.
VARIANTS: List[Tuple[str, object, Dict[str, str], Dict[str, object]]] = [
    ("quantize 4-bit bf16 stochastic", quantize_kernel, {"x_ptr": "*i16"},
     dict(X_BF16=True, STOCHASTIC=True, GROUP=2048, BLOCK=2048, GROUPS_PER_PROGRAM=2)),
    ("quantize 2-bit fp32 nearest, tail", quantize_kernel, {},
     dict(BITS=2, GROUP=64, BLOCK=64, GROUPS_PER_PROGRAM=64, TAIL=True)),
    ("weight diff fp32 - bf16", quantize_kernel, {"y_ptr": "*i16"},
     dict(HAS_Y=True, Y_BF16=True, STOCHASTIC=True, GROUP=2048, BLOCK=2048, GROUPS_PER_PROGRAM=2)),
    ("hadamard 8-bit bf16 stochastic", quantize_kernel, {"x_ptr": "*i16", "codes_ptr": "*i8"},
     dict(X_BF16=True, BITS=8, HADAMARD=32, STOCHASTIC=True, SCALED=True)),
    ("hadamard 8-bit block 256 nearest", quantize_kernel, {"codes_ptr": "*i8"},
     dict(BITS=8, GROUP=256, BLOCK=256, GROUPS_PER_PROGRAM=16, HADAMARD=256)),
    ("quantize sliced group (two passes)", quantize_kernel, {},
     dict(GROUP=32768, BLOCK=8192, GROUPS_PER_PROGRAM=1, HADAMARD=32, STOCHASTIC=True)),
    ("dequantize-sum-requantize 8->4 bits", quantize_kernel, {"src_codes_ptr": "*i8"},
     dict(SOURCE=SOURCE_CHUNKS, SRC_BITS=8, SRC_GROUP=128, STOCHASTIC=True)),
    # The other ways a requantize tile meets its source (quantize_kernel._source_values):
    ("dequantize-sum-requantize 4->4 bits, sliced group", quantize_kernel, {},
     dict(SOURCE=SOURCE_CHUNKS, SRC_BITS=4, SRC_GROUP=16, GROUP=10000, BLOCK=8192,
          GROUPS_PER_PROGRAM=1, TAIL=True)),
    ("dequantize-sum-requantize 2->4 bits, group 3000 per program", quantize_kernel, {},
     dict(SOURCE=SOURCE_CHUNKS, SRC_BITS=2, SRC_GROUP=8, GROUP=3000, BLOCK=4096,
          GROUPS_PER_PROGRAM=1, TAIL=True)),
    ("dequantize-sum-requantize 8->8 bits, groups of 96", quantize_kernel,
     {"src_codes_ptr": "*i8", "codes_ptr": "*i8"},
     dict(SOURCE=SOURCE_CHUNKS, SRC_BITS=8, SRC_GROUP=32, BITS=8, GROUP=96, BLOCK=128,
          GROUPS_PER_PROGRAM=32, TAIL=True)),
    ("dequantize 4-bit -> bf16", dequantize_kernel, {"out_ptr": "*i16"}, dict(OUT_BF16=True)),
    ("dequantize 2-bit -> fp16", dequantize_kernel, {"out_ptr": "*fp16"}, dict(BITS=2, GROUP=64)),
    ("dequantize_add_ 4-bit into bf16", dequantize_kernel, {"out_ptr": "*i16"},
     dict(OUT_BF16=True, ACCUMULATE=True, GROUP=2048)),
    ("dequantize_sum 4-bit + inverse hadamard", dequantize_kernel, {}, dict(HADAMARD=32)),
    ("dequantize_sum 8-bit + inverse hadamard -> bf16", dequantize_kernel,
     {"codes_ptr": "*i8", "out_ptr": "*i16"}, dict(BITS=8, HADAMARD=32, OUT_BF16=True)),
]

# Instructions whose presence would break bit equality with the reference.
FORBIDDEN_PTX = {
    "fused multiply-add": re.compile(r"\bfma\.rn\.f32\b|\bmad\.f32\b"),
    "flush-to-zero": re.compile(r"\.ftz\b"),
    "approximate division": re.compile(r"\bdiv\.(approx|full)\.f32\b"),
}


def compile_variant(kernel, arg_types: Dict[str, str], constexprs: Dict[str, object],
                    arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(arg_types)
    signature.update({name: "constexpr" for name in constexprs})
    tile = constexprs.get("BLOCK", 0) * constexprs.get("GROUPS_PER_PROGRAM", 1)
    options = dict(launch.exact_fp_options(), num_warps=launch.num_warps_for(tile))
    # What a launch on large torch tensors gets: Triton marks every 16-byte-aligned
    # pointer and every integer divisible by 16 (not num_chunks: 2..8 ranks) as such,
    # which lets it vectorise loads and stores. Without these hints the PTX would
    # show scalar accesses that a real launch does not make.
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in arg_types.items() if kind.startswith("*")
               or (kind == "i32" and name != "num_chunks")}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs=aligned),
                          target=GPUTarget("cuda", arch, 32), options=options)


def check_all(arch: int = 90, verbose: bool = True) -> List[str]:
    """Compile every variant; return the list of problems (empty = all good)."""
    problems = []
    for name, kernel, types, consts in VARIANTS:
        defaults = (_QUANTIZE_ARGS, _QUANTIZE_DEFAULTS) if kernel is quantize_kernel \
            else (_DEQUANTIZE_ARGS, _DEQUANTIZE_DEFAULTS)
        arg_types = dict(defaults[0], **types)
        constexprs = dict(defaults[1], **consts)
        start = time.perf_counter()
        try:
            compiled = compile_variant(kernel, arg_types, constexprs, arch)
        except Exception as error:  # report every variant, not just the first failure
            problems.append(f"{name}: does not compile: {type(error).__name__}: {error}")
            continue
        ptx = compiled.asm["ptx"]
        bad = [what for what, pattern in FORBIDDEN_PTX.items() if pattern.search(ptx)]
        if bad:
            problems.append(f"{name}: PTX contains {', '.join(bad)}")
        if verbose:
            print(f"sm_{arch} {name}: {'BAD ' + ', '.join(bad) if bad else 'ok'} "
                  f"({time.perf_counter() - start:.1f} s, {compiled.metadata.shared} B shared)")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 = A100)")
    args = parser.parse_args()
    from megatron_sdp4bit.quant.triton_kernels.tile_math import INTERPRETED
    if INTERPRETED:
        print("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
        return 2
    problems = check_all(args.arch)
    for problem in problems:
        print("FAIL", problem)
    print("compile check:", "FAIL" if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
