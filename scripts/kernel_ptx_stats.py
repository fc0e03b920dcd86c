#!/usr/bin/env python
"""Static per-element instruction counts of every Triton kernel variant, no GPU needed.

Compiles the variants of ``megatron_sdp4bit.quant.triton_kernels.variants`` (the
collectives' real calls, then the other branches) exactly as those calls would
compile them on a GPU (Triton's LLVM and ptxas run on the CPU), and counts, in
the SASS (nvdisasm of the cubin, NOPs excluded), what bounds the speed of a
memory-bound kernel:

    SASS/elem   SASS instructions per element: a thread runs straight-line code,
                so the static count over the elements it owns (tile / (32 * warps))
                ~ the executed count per element (loops excepted: '*' below). The
                IEEE division's slow-path subroutine, which runs only when the
                per-group division meets a subnormal, huge or special operand, is
                not counted (``cold_instructions`` in the JSON)
    conv/elem   conversions per element: F2I, I2F, FRND and F2F (with their sm_90
                forms I2FP, F2FP, F2IP): 16 per clock per SM on sm_90, 1/8 of the
                fp32 rate, so they can bound a kernel before instruction issue does
    LDG/elem    global load instructions; LDS+STS/elem: shared-memory accesses
    B/elem      bytes the kernel must move per element of its tile (inputs read +
                outputs written, as scripts/bench_quant.py counts them: packed codes,
                one fp32 scale per group, every received chunk)
    issue TB/s  the bandwidth at which instruction issue alone would saturate an
                H200: 132 SMs x 4 schedulers x 32 lanes x 1.98 GHz = 3.35e13
                thread-instructions/s / (SASS/elem / B/elem)
    conv TB/s   the same for conversions: 132 x 16 x 1.98 GHz = 4.18e12 conversions/s
                / (conv/elem / B/elem)
    bound       the lower of the two; target = at least --target TB/s (6.0: at the
                ~60% of issue peak such kernels reach, about 0.9 of an H200's clone
                bandwidth). The target applies to the real calls; those below it
                are listed after the table with their opcode mix per element.

A loop left in the SASS (a branch back up) has its body counted once: such rows
are marked '*' (their counts are low).

    python scripts/kernel_ptx_stats.py [--arch 90] [--json stats.json] [--only real]

Must run without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

from megatron_sdp4bit.quant.triton_kernels import compile_check

H200_SMS, H200_CLOCK_HZ = 132, 1.98e9
H200_THREAD_INSTRUCTIONS_PER_S = H200_SMS * 4 * 32 * H200_CLOCK_HZ
H200_CONVERSIONS_PER_S = H200_SMS * 16 * H200_CLOCK_HZ
TARGET_TBPS = 6.0
CONVERSIONS = ("F2I", "I2F", "FRND", "F2F")  # opcode prefixes: also I2FP, F2FP, F2IP
_POINTER_BYTES = {"*fp32": 4, "*i16": 2, "*fp16": 2, "*bf16": 2, "*fp64": 8}
_SASS_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def bytes_per_element(launch) -> float:
    """Bytes read + written per element of the tile (per output element)."""
    c, types = launch.constexpr, launch.signature
    if launch.name == "quantize_kernel":
        if c("SOURCE") == 1:  # received chunks
            moved = c("NUM_CHUNKS") * (c("SRC_BITS") / 8 + 4 / c("SRC_GROUP"))
        else:
            moved = _POINTER_BYTES[types["x_ptr"]]
            if c("HAS_Y"):
                moved += _POINTER_BYTES[types["y_ptr"]]
        return moved + c("BITS") / 8 + 4 / c("GROUP")
    out = _POINTER_BYTES[types["out_ptr"]] * (2 if c("ACCUMULATE") else 1)
    return c("NUM_CHUNKS") * (c("BITS") / 8 + 4 / c("GROUP")) + out


def _nvidia_tool(name: str, cubin: bytes, *flags: str) -> str:
    """stdout of one of the CUDA binary tools Triton ships, run on ``cubin``; '' if missing."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True).stdout


def sass_listing(cubin: bytes) -> str:
    """The cubin's SASS as nvdisasm prints it."""
    return _nvidia_tool("nvdisasm", cubin)


def registers(cubin: bytes) -> int:
    """Registers per thread (cuobjdump's resource usage; 0 if unknown)."""
    found = re.search(r"REG:(\d+)", _nvidia_tool("cuobjdump", cubin, "--dump-resource-usage"))
    return int(found.group(1)) if found else 0


def split_cold(listing: str):
    """(kernel body, cold subroutines) of a listing: the IEEE division's slow path
    ($__internal_..._div_rn_..._slowpath, called only when FCHK flags a subnormal,
    huge or special operand of the per-group division) follows the kernel's code."""
    found = re.search(r"^\$__internal_\S+:", listing, flags=re.MULTILINE)
    return (listing, "") if found is None else (listing[:found.start()], listing[found.start():])


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


def stats(name: str, call, arch: int, real: bool) -> dict:
    launch = compile_check.record_variant(call, arch)
    compiled = launch.compile()
    groups = launch.constexpr("GROUPS_PER_PROGRAM") if launch.name == "quantize_kernel" else 1
    tile = launch.constexpr("BLOCK") * groups
    per_thread = tile / (compiled.metadata.num_warps * 32)  # elements each thread owns
    listing, cold = split_cold(sass_listing(compiled.asm["cubin"]))
    sass = sass_instructions(listing)
    opcodes = [op.split(".")[0] for op in sass]
    conversions = collections.Counter(op for op in opcodes if op.startswith(CONVERSIONS))
    moved = bytes_per_element(launch)
    sass_per_elem = len(sass) / per_thread
    conv_per_elem = sum(conversions.values()) / per_thread
    issue = H200_THREAD_INSTRUCTIONS_PER_S / (sass_per_elem / moved) / 1e12
    conversion = (H200_CONVERSIONS_PER_S / (conv_per_elem / moved) / 1e12 if conv_per_elem
                  else float("inf"))
    return dict(
        name=name, real_call=real, loop=has_loop(listing), tile=tile,
        warps=compiled.metadata.num_warps, registers=registers(compiled.asm["cubin"]),
        sass_per_elem=sass_per_elem, conversions_per_elem=conv_per_elem,
        conversion_kinds={op: n / per_thread for op, n in sorted(conversions.items())},
        shared_per_elem=sum(op.startswith(("LDS", "STS")) for op in opcodes) / per_thread,
        ldg_per_elem=sum(op.startswith("LDG") for op in opcodes) / per_thread,
        shared_bytes=compiled.metadata.shared, bytes_per_elem=moved,
        cold_instructions=len(sass_instructions(cold)),
        mix={op: n / per_thread for op, n in collections.Counter(opcodes).most_common(12)},
        issue_tbps=issue, conversion_tbps=conversion, bound_tbps=min(issue, conversion),
    )


def format_row(s: dict, target: float) -> str:
    conv = " ".join(f"{op} {n:.2f}" for op, n in s["conversion_kinds"].items()) or "-"
    verdict = ("yes" if s["bound_tbps"] >= target else "**no**") if s["real_call"] else "-"
    return (f"| {s['name']}{' *' if s['loop'] else ''} | {s['tile']} | {s['warps']} | "
            f"{s['registers']} | {s['sass_per_elem']:.1f} | {s['conversions_per_elem']:.2f} ({conv}) | "
            f"{s['ldg_per_elem']:.2f} | {s['shared_per_elem']:.2f} | {s['bytes_per_elem']:.3f} | "
            f"{s['issue_tbps']:.1f} | {s['conversion_tbps']:.1f} | {verdict} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write every figure per kernel variant as JSON")
    parser.add_argument("--only", choices=("real", "coverage", "all"), default="all",
                        help="which variants (default all)")
    parser.add_argument("--target", type=float, default=TARGET_TBPS,
                        help="TB/s the lower bound must reach (real calls)")
    args = parser.parse_args(argv)
    from megatron_sdp4bit.quant.triton_kernels.tile_math import INTERPRETED
    if INTERPRETED:
        print("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
        return 2
    real_names = {name for name, _ in compile_check.variants("real")}
    print(f"sm_{args.arch}, per element of a program's tile (* = a loop body counted once); "
          f"target: min(issue, conv) >= {args.target} TB/s for the real calls")
    print("| kernel variant | tile | warps | regs | SASS/elem | conv/elem | LDG/elem | "
          "LDS+STS/elem | B/elem | issue TB/s | conv TB/s | >= target |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|:---:|")
    rows = []
    for name, call in compile_check.variants(args.only):
        rows.append(stats(name, call, args.arch, name in real_names))
        print(format_row(rows[-1], args.target), flush=True)
    missed = [s for s in rows if s["real_call"] and s["bound_tbps"] < args.target]
    print(f"real calls below {args.target} TB/s: {len(missed)}")
    for s in missed:  # what they spend their instructions on, per element
        mix = ", ".join(f"{op} {n:.2f}" for op, n in s["mix"].items())
        print(f"- {s['name']}: {s['sass_per_elem']:.1f}/elem for {s['bytes_per_elem']:.2f} B: {mix}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(arch=args.arch, target_tbps=args.target, kernels=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
