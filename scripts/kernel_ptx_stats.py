#!/usr/bin/env python
"""Static per-element instruction counts of every Triton kernel variant, no GPU needed.

Compiles the variants of ``compile_check.VARIANTS`` for an NVIDIA architecture
(Triton's LLVM and ptxas run on the CPU) and counts, in the PTX and TTGIR, what
predicts the speed of a memory-bound kernel:

    SASS/elem   SASS instructions (nvdisasm of the cubin, NOPs excluded) per element,
                counted like PTX/elem below; SASS LDS+STS/elem: its shared accesses;
                LDG/elem: its global loads (a 16-byte load of 4-bit codes serves 32
                elements, a byte-wise one 2)
    PTX/elem    PTX instructions (lines ending in ';' that are not declarations)
                of one thread / elements that thread owns (tile / (32 * warps)):
                every thread runs straight-line code, so static count ~ executed
                count per element (loops excepted, see below)
    PTX shared/elem per element, ld.shared + st.shared (+ ldmatrix/stmatrix): layout conversions go
                through shared memory
    bar         bar.sync / barrier.sync per program (one per conversion, roughly)
    vec         widest global load/store in bits (128 = fully vectorised)
    cvt         ttg.convert_layout ops in the TTGIR that were not optimised away
    philox/elem mul.hi.u32 per element (Philox-4x32-10 uses up to 20 per call)
    shared B    shared memory per program
    B/elem      bytes the kernel must move per element of its tile (inputs read +
                outputs written, as scripts/bench_quant.py counts them: packed codes,
                one fp32 scale per group, every received chunk)
    SASS/B      SASS/elem / B/elem: instructions per byte moved
    issue TB/s  the bandwidth at which instruction issue alone would saturate an
                H200: 132 SMs x 4 schedulers x 32 lanes x 1.98 GHz = 3.35e13
                thread-instructions/s, divided by SASS/B. An upper bound (perfect
                issue, no stalls); a kernel needs it well above its clone bandwidth
                to stay memory-bound

Counts are static. The chunk loop of the dequantize-sum variants is compiled for
4 chunks (num_chunks made a compile-time constant, as for 4 ranks; ``--chunks``
changes it: the difference between two counts is the cost of the extra chunks), which
usually lets the compiler unroll it; the other variants for 1 chunk, which Triton
also does at run time (it specialises integer arguments equal to 1). A loop left in the SASS (a branch back up)
has its body counted once: such rows are marked '*'.

    python scripts/kernel_ptx_stats.py [--arch 90] [--chunks 4]

Must run without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

try:
    from megatron_sdp4bit.quant.triton_kernels import compile_check
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_sdp4bit.quant.triton_kernels import compile_check

from megatron_sdp4bit.quant.triton_kernels.dequantize_kernel import dequantize_kernel
from megatron_sdp4bit.quant.triton_kernels.quantize_kernel import quantize_kernel

_DECLARATION = re.compile(r"^\s*(\.|//|\}|\{|\$|@?\s*$)")
_SHARED = re.compile(r"\b(ld\.shared|st\.shared|ldmatrix|stmatrix|ld\.volatile\.shared)")
_BARRIER = re.compile(r"\b(bar\.sync|barrier\.sync)\b")
_PHILOX_MUL = re.compile(r"\bmul\.hi\.u32\b")
# ld.global.v4.b32 = 128 bits; ld.global.b16 = 16 bits; st.global.v2.b32 = 64 bits ...
_GLOBAL_ACCESS = re.compile(r"\b(?:ld|st)\.global(?:\.\w+)*?(?:\.v(\d))?\.[bsuf](\d+)\b")
# The fp32 launches scripts/bench_quant.py times (tiles as launch.quantize_tiling picks
# them with the default tuning), next to compile_check's variants.
BENCH_VARIANTS = [
    ("bench: quantize 4-bit fp32 stochastic G=2048", quantize_kernel, {},
     dict(STOCHASTIC=True, GROUP=2048, BLOCK=2048, GROUPS_PER_PROGRAM=2)),
    ("bench: quantize 4-bit fp32 nearest G=2048", quantize_kernel, {},
     dict(GROUP=2048, BLOCK=2048, GROUPS_PER_PROGRAM=2)),
    ("bench: hadamard 8-bit fp32 G=128 H=32 stochastic", quantize_kernel, {"codes_ptr": "*i8"},
     dict(BITS=8, HADAMARD=32, STOCHASTIC=True, SCALED=True)),
    ("bench: dequantize 4-bit G=2048 -> fp32", dequantize_kernel, {}, dict(GROUP=2048)),
    # The other bench rows launch compile_check variants as they are: "weight diff fp32 -
    # bf16", "dequantize_add_ 4-bit into bf16", "dequantize-sum-requantize 8->4 bits",
    # "dequantize_sum 4-bit + inverse hadamard".
]
H200_THREAD_INSTRUCTIONS_PER_S = 132 * 4 * 32 * 1.98e9
_POINTER_BYTES = {"*fp32": 4, "*i16": 2, "*fp16": 2, "*bf16": 2}


def bytes_per_element(kernel, arg_types, constexprs) -> float:
    """Bytes read + written per element of the tile (per output element)."""
    c = constexprs
    chunks = c.get("num_chunks", 1)
    if kernel is quantize_kernel:
        if c["SOURCE"] == 0:
            moved = _POINTER_BYTES[arg_types["x_ptr"]]
            if c["HAS_Y"]:
                moved += _POINTER_BYTES[arg_types["y_ptr"]]
        else:
            moved = chunks * (c["SRC_BITS"] / 8 + 4 / c["SRC_GROUP"])
        return moved + c["BITS"] / 8 + 4 / c["GROUP"]
    out = _POINTER_BYTES[arg_types["out_ptr"]] * (2 if c["ACCUMULATE"] else 1)
    return chunks * (c["BITS"] / 8 + 4 / c["GROUP"]) + out
_CHUNKED_VARIANTS = ("dequantize-sum-requantize", "dequantize_sum")


_SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_listing(cubin: bytes) -> str:
    """The cubin's SASS as nvdisasm prints it (nvdisasm ships with Triton); '' if missing."""
    import triton
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, f.name], capture_output=True, text=True).stdout


def sass_instructions(listing: str):
    return [op for op in _SASS_INSTRUCTION.findall(listing) if op != "NOP"]


def has_loop(listing: str) -> bool:
    """A branch back to a label above it: a loop the compiler did not unroll.

    The branch-to-itself that pads every kernel after EXIT does not count.
    """
    seen = {}  # label -> instructions seen before it
    count = 0
    for line in listing.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            seen[label.group(1)] = count
        if _SASS_INSTRUCTION.search(line):
            count += 1
        target = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", line)
        if target and target.group(1) in seen and count - seen[target.group(1)] > 1:
            return True
    return False


def ptx_instructions(ptx: str):
    for line in ptx.splitlines():
        text = line.strip()
        if text.endswith(";") and not _DECLARATION.match(text):
            yield text


def stats(name, kernel, types, consts, arch, chunks=4):
    defaults = ((compile_check._QUANTIZE_ARGS, compile_check._QUANTIZE_DEFAULTS)
                if kernel is quantize_kernel else
                (compile_check._DEQUANTIZE_ARGS, compile_check._DEQUANTIZE_DEFAULTS))
    # Parameters the kernel does not have are dropped, so that this script also
    # measures older versions of the kernels (PYTHONPATH=<checkout of an old commit>).
    constexprs = {k: v for k, v in dict(defaults[1], **consts).items() if k in kernel.arg_names}
    arg_types = dict(defaults[0], **types)
    # Triton compiles an integer argument equal to 1 as a constant: a launch with
    # one chunk (plain dequantize, every quantize of a tensor) has no chunk loop.
    del arg_types["num_chunks"]
    constexprs["num_chunks"] = 1
    if any(word in name for word in _CHUNKED_VARIANTS):
        constexprs["num_chunks"] = chunks
        name += f" ({chunks} chunk{'s' if chunks > 1 else ''})"
    compiled = compile_check.compile_variant(kernel, arg_types, constexprs, arch)
    tile = constexprs["BLOCK"] * constexprs.get("GROUPS_PER_PROGRAM", 1)
    per_thread = tile / (compiled.metadata.num_warps * 32)  # elements each thread owns
    ptx = compiled.asm["ptx"]
    ttgir = compiled.asm["ttgir"]
    instructions = list(ptx_instructions(ptx))
    listing = sass_listing(compiled.asm["cubin"])
    sass = sass_instructions(listing)
    if has_loop(listing):
        name += " *"
    per_byte = len(sass) / per_thread / bytes_per_element(kernel, arg_types, constexprs)
    return dict(
        name=name,
        tile=tile,
        warps=compiled.metadata.num_warps,
        instr=len(instructions) / per_thread,
        sass=len(sass) / per_thread,
        sass_shared=sum(op.startswith(("LDS", "STS")) for op in sass) / per_thread,
        ldg=sum(op.startswith("LDG") for op in sass) / per_thread,
        shared=sum(bool(_SHARED.search(i)) for i in instructions) / per_thread,
        bar=sum(bool(_BARRIER.search(i)) for i in instructions),
        cvt=ttgir.count("ttg.convert_layout"),
        vec=max((int(m.group(1) or 1) * int(m.group(2))
                 for m in map(_GLOBAL_ACCESS.search, instructions) if m), default=0),
        philox=sum(bool(_PHILOX_MUL.search(i)) for i in instructions) / per_thread,
        smem=compiled.metadata.shared,
        bytes=bytes_per_element(kernel, arg_types, constexprs),
        per_byte=per_byte,
        issue_tbps=H200_THREAD_INSTRUCTIONS_PER_S / per_byte / 1e12,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10")
    parser.add_argument("--chunks", type=int, default=4,
                        help="chunks the dequantize-sum variants are compiled for")
    args = parser.parse_args()
    from megatron_sdp4bit.quant.triton_kernels.tile_math import INTERPRETED
    if INTERPRETED:
        print("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
        return 2
    print(f"sm_{args.arch}, per element of a program's tile (* = a loop body counted once)")
    print("| variant | tile | warps | SASS/elem | SASS LDS+STS/elem | LDG/elem | PTX/elem | PTX shared/elem | bar | cvt | philox mul/elem | vec | shared B | B/elem | SASS/B | issue TB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant in BENCH_VARIANTS + compile_check.VARIANTS:
        s = stats(*variant, args.arch, args.chunks)
        print(f"| {s['name']} | {s['tile']} | {s['warps']} | {s['sass']:.1f} | {s['sass_shared']:.2f} | "
              f"{s['ldg']:.2f} | {s['instr']:.1f} | "
              f"{s['shared']:.3f} | {s['bar']} | {s['cvt']} | {s['philox']:.2f} | {s['vec']} | {s['smem']} | "
              f"{s['bytes']:.3f} | {s['per_byte']:.1f} | {s['issue_tbps']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
