"""Compile every kernel variant for an NVIDIA architecture, no GPU needed.

Triton's front end, LLVM and ptxas all run on the CPU, so this catches what the
CPU interpreter cannot: code that the interpreter runs (it executes Python and
numpy) but the compiler rejects, and unwanted instructions in the PTX (fused
multiply-adds, flush-to-zero, approximate division), which would break bit
equality with the reference. The variants (``variants.py``) are real op calls,
recorded as they would launch on a GPU (``launch_record.py``), so what is
compiled here is what those calls compile.

    python -m megatron_sdp4bit.quant.triton_kernels.compile_check [--arch 90] [--jobs N] [--ptx-dir DIR]

``--ptx-dir`` also writes each variant's PTX without its debug lines, so a change
meant to leave the generated code alone can be checked: ``diff -r before after``.

Must run without TRITON_INTERPRET=1 (the kernels must be JIT functions).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import List, Optional, Sequence

from megatron_sdp4bit.quant.triton_kernels.launch_record import Launch, recording

# Instructions whose presence would break bit equality with the reference. The one
# intended fused multiply-add, stochastic rounding's x * inv + 1.5 * 2^15
# (rounding.stochastic_t: its addend is the constant 0f47400000), is not one of them.
FORBIDDEN_PTX = {
    "fused multiply-add": re.compile(r"\bfma\.rn\.f32\s[^;]*,\s*(?!0f47400000\s*;)[^\s,;][^,;]*;"
                                     r"|\bmad\.f32\b"),
    "flush-to-zero": re.compile(r"\.ftz\b"),
    "approximate division": re.compile(r"\bdiv\.(approx|full)\.f32\b"),
}


# What moves when only the source's line numbers do: .loc/.file directives, the
# debug-label lines they reference, comments and the DWARF sections.
_DEBUG_LINE = re.compile(r"^\s*(\.loc\b|\.file\b|//|\$L__tmp\d+:\s*$)")


def comparable_ptx(ptx: str) -> str:
    """``ptx`` without its debug information: equal for equal code."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in code.splitlines() if line.strip() and not _DEBUG_LINE.match(line)) + "\n"


def variant_file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") + ".ptx"


def _empty_folder(path: str) -> None:
    """Create ``path``, or refuse one that holds files: stale PTX would mislead a diff."""
    os.makedirs(path, exist_ok=True)
    if os.listdir(path):
        raise SystemExit(f"--ptx-dir {path} is not empty: pass a new or empty folder "
                         "(files of an earlier run would mislead a diff)")


def record_variant(call, arch: int) -> Launch:
    """The one launch ``call`` makes, recorded for ``arch``."""
    with recording(arch) as launches:
        call()
    if len(launches) != 1:
        raise RuntimeError(f"a variant must launch one kernel, this one launched {len(launches)}")
    return launches[0]


def variants(which: str = "all") -> list:
    """(name, call) of the real calls, the coverage variants, or both."""
    from megatron_sdp4bit.quant.triton_kernels.variants import COVERAGE, REAL_CALLS
    return {"real": REAL_CALLS, "coverage": COVERAGE, "all": REAL_CALLS + COVERAGE}[which]


def _compile_one(index: int, which: str, arch: int) -> tuple:
    """(name, ptx, shared bytes, seconds, error) of variant ``index``: a pool's task."""
    name, call = variants(which)[index]
    start = time.perf_counter()
    try:
        compiled = record_variant(call, arch).compile()
    except Exception as error:  # report every variant, not just the first failure
        return name, None, 0, time.perf_counter() - start, f"{type(error).__name__}: {error}"
    return name, compiled.asm["ptx"], compiled.metadata.shared, time.perf_counter() - start, None


def _compiled(which: str, arch: int, jobs: int):
    """Every variant's ``_compile_one`` in order. Triton's front end and LLVM hold the
    interpreter, so variants compile in ``jobs`` processes (a fresh GPU box: 40 s in one
    process for 39 variants); forked, as nothing here touches a GPU."""
    count = len(variants(which))
    if jobs <= 1:
        yield from (_compile_one(i, which, arch) for i in range(count))
        return
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        yield from pool.map(_compile_one, range(count), [which] * count, [arch] * count)


def check_all(arch: int = 90, verbose: bool = True, which: str = "all",
              ptx_dir: Optional[str] = None, jobs: int = 1) -> List[str]:
    """Compile every variant; return the list of problems (empty = all good). With
    ``ptx_dir``, each variant's ``comparable_ptx`` is written there."""
    problems = []
    if ptx_dir is not None:
        _empty_folder(ptx_dir)
    for name, ptx, shared, seconds, error in _compiled(which, arch, jobs):
        if error is not None:
            problems.append(f"{name}: does not compile: {error}")
            continue
        if ptx_dir is not None:
            with open(os.path.join(ptx_dir, variant_file_name(name)), "x") as f:  # names are unique
                f.write(comparable_ptx(ptx))
        bad = [what for what, pattern in FORBIDDEN_PTX.items() if pattern.search(ptx)]
        if bad:
            problems.append(f"{name}: PTX contains {', '.join(bad)}")
        if verbose:
            print(f"sm_{arch} {name}: {'BAD ' + ', '.join(bad) if bad else 'ok'} "
                  f"({seconds:.1f} s, {shared} B shared)")
    return problems


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 = A100)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes compiling variants side by side (default: up to 8)")
    parser.add_argument("--ptx-dir", default=None,
                        help="also write each variant's PTX, debug lines removed, to this folder")
    args = parser.parse_args(argv)
    from megatron_sdp4bit.quant.triton_kernels.tile_math import INTERPRETED
    if INTERPRETED:
        print("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
        return 2
    problems = check_all(args.arch, ptx_dir=args.ptx_dir, jobs=args.jobs)
    for problem in problems:
        print("FAIL", problem)
    print("compile check:", "FAIL" if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
