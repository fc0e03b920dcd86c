#!/usr/bin/env python
"""Check the Triton quantization kernels on a CUDA machine; print a pass/fail summary.

Steps (each reported PASS/FAIL; the exit status is 0 only if all pass):
  compile:  every kernel variant compiles for this GPU's architecture with no
            FMA contraction, flush-to-zero or approximate division in the PTX;
  tests:    tests/quant/test_triton.py, test_triton_chunks.py (wire tensors, out=,
            the rows op), test_triton_offsets.py (chunks of 2^31+ elements) on CUDA tensors with compiled kernels, tests/quant/test_warmup.py
            (after warm_up the JIT cache gains no entry) (SDP4BIT_TRITON_TEST_DEVICE=cuda):
            bit-identical to the CPU reference with nearest rounding, stochastic rounding
            floor-or-ceil / unbiased / reproducible;
  large:    the gradient path (Hadamard quantize -> dequantize-sum-requantize ->
            dequantize-sum, flat and through wire buffers with the rows op) and the
            weight path on ~33M elements (many programs, the default tile sizes),
            bit-identical to the CPU reference;
  dispatch: megatron_sdp4bit.quant sends CUDA tensors to the Triton backend;
  speed (information, never fails; not with --no-bench): median time of each op,
            Triton vs the torch reference on the same GPU.

Needs a CUDA build of torch and Triton, and the package importable (``make setup``,
or ``PYTHONPATH`` at the checkout as scripts/gpu_check.sh sets it). Run from the
repository root:
    python scripts/gpu_check_triton.py            # a few minutes, mostly Triton compiling
    python scripts/gpu_check_triton.py --no-bench --steps compile,large --json out.json

``--device cpu`` is this script's self-test (scripts/gpu_check.sh --cpu-smoke): the
same steps on CPU tensors in Triton's interpreter, with a few tests and small sizes;
compile still compiles for sm_90 (no GPU needed for that).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("compile", "tests", "large", "dispatch")
# On CPU (the interpreter is slow): a few tests that cover every kernel once.
CPU_TESTS = ("quantize_nearest_is_bit_identical or dequantize_is_bit_identical or test_received_8bit"
             " or k_chunk_consumers_read_like_the_flat_layout or rows_op_nearest")
TEST_FILES = ("tests/quant/test_triton.py", "tests/quant/test_triton_chunks.py",
              "tests/quant/test_triton_offsets.py", "tests/quant/test_warmup.py")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: self-test in Triton's interpreter with tiny sizes")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--no-bench", action="store_true", help="skip the speed table")
    parser.add_argument("--bench-numel", type=int, default=1 << 26)
    parser.add_argument("--large-chunk", type=int, default=None,
                        help="elements per rank of the large check (a multiple of 128; "
                        "default 8M + 384 on CUDA, 3072 on CPU)")
    parser.add_argument("--tests-k", default=None,
                        help="pytest -k expression for the tests step (default: all on CUDA, "
                        "a few on CPU)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
# Triton reads TRITON_INTERPRET when it is imported: decide before torch/triton load.
if ARGS is not None and ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import torch  # noqa: E402


def _python_env(**changes) -> dict:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **changes)


def step_compile(arch: int) -> str:
    """In a fresh process: compile_check needs Triton imported without the interpreter."""
    result = subprocess.run(
        [sys.executable, "-m", "megatron_sdp4bit.quant.triton_kernels.compile_check",
         "--arch", str(arch)],
        cwd=ROOT, env=_python_env(TRITON_INTERPRET="0"), capture_output=True, text=True,
        timeout=300,
    )
    lines = result.stdout.strip().splitlines()
    print("   ", lines[-1] if lines else "(no compile_check output)")
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-2000:], sep="\n")
        return f"compile_check for sm_{arch} failed (exit {result.returncode})"
    return ""


def step_tests(device: str, k_expr) -> str:
    env = _python_env(SDP4BIT_TRITON_TEST_DEVICE=device)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        k_expr = k_expr or CPU_TESTS
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           *TEST_FILES] + (["-k", k_expr] if k_expr else [])
    workers = int(os.environ.get("GPU_CHECK_TEST_WORKERS", "8"))
    if device == "cuda" and workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]  # Triton compiles each kernel variant: spread that over cores
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    lines = result.stdout.strip().splitlines()
    print("   ", lines[-1] if lines else "(no pytest output)")
    if result.returncode != 0:
        print(result.stdout[-8000:], result.stderr[-2000:], sep="\n")
        return "pytest failed: " + (lines[-1] if lines else f"exit {result.returncode}")
    return ""


def step_large(device: str, chunk: int) -> str:
    from megatron_sdp4bit.diagnostics.kernel_identity import large_path_differences

    problems = large_path_differences(device, chunk)
    return ", ".join(problems) + (" differ from the reference" if problems else "")


def step_dispatch(device: str) -> str:
    from megatron_sdp4bit import quant
    backend = quant.backend_for(torch.empty(1, device=device)).__name__
    expected = "triton_ops" if device == "cuda" else "reference"
    return "" if backend.endswith(expected) else f"{device} tensors go to {backend}, not {expected}"


def _median_ms(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_bench(numel: int) -> None:
    from megatron_sdp4bit.quant import reference as R
    from megatron_sdp4bit.quant import triton_ops as T

    x = torch.randn(numel, device="cuda").to(torch.bfloat16)
    main = torch.randn(numel, device="cuda")
    q8 = T.hadamard_quantize(x, 8, 128, 32)
    q4 = T.quantize(main, 4, 2048)
    ops = {
        "quantize 4b g2048 (fp32)": lambda M: M.quantize(main, 4, 2048),
        "quantize_weight_diff 4b": lambda M: M.quantize_weight_diff(main, x, 4, 2048),
        "dequantize_add_ 4b -> bf16": lambda M: M.dequantize_add_(x, q4),
        "hadamard_quantize 8b g128 (bf16)": lambda M: M.hadamard_quantize(x, 8, 128, 32),
        "dequantize_sum_requantize 4x 8b->4b": lambda M: M.dequantize_sum_requantize(q8, 4, 4, 128),
        "dequantize_sum 4x 8b + H^-1": lambda M: M.dequantize_sum(q8, 4, 32),
        "hadamard_quantize_rows 8b (bf16, order)":
            lambda M: M.hadamard_quantize_rows(rows, order, 0, width, width, 8, 128, 32),
    }
    rows, width = x.view(8, -1), numel // 8
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device="cuda")
    print(f"    {numel / 2**20:.0f} Mi elements; median ms over 10 runs")
    print(f"    {'op':40s} {'triton':>8s} {'torch':>8s} {'speedup':>8s}")
    for name, op in ops.items():
        t_triton = _median_ms(lambda: op(T))
        t_torch = _median_ms(lambda: op(R), repeats=3)
        print(f"    {name:40s} {t_triton:8.2f} {t_torch:8.2f} {t_torch / t_triton:7.1f}x")


def main(args: argparse.Namespace) -> int:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU tests are tests/quant/test_triton.py; "
              "--device cpu is this script's self-test)")
        return 2
    import triton
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor
        where = f"{torch.cuda.get_device_name()} (sm_{arch})"
    else:
        arch, where = 90, "CPU, Triton interpreter (self-test; compile for sm_90)"
    print(f"{where}, torch {torch.__version__}, triton {triton.__version__}")
    chunk = args.large_chunk or ((1 << 23) + 128 * 3 if device == "cuda" else 128 * 24)

    def large():
        if device == "cpu":  # the interpreter pays per program: few, large ones
            from megatron_sdp4bit.quant.triton_kernels import launch_plan
            with launch_plan.tuning(tile_elements=1 << 16):
                return step_large(device, chunk)
        return step_large(device, chunk)

    runners = {"compile": lambda: step_compile(arch), "tests": lambda: step_tests(device, args.tests_k),
               "large": large, "dispatch": lambda: step_dispatch(device)}
    results = {}
    for name in [s for s in STEPS if s in args.steps]:
        start = time.perf_counter()
        try:
            problem = runners[name]()
        except Exception as error:  # report and go on to the next step
            problem = f"{type(error).__name__}: {error}"
        seconds = time.perf_counter() - start
        results[name] = {"status": "FAIL" if problem else "PASS", "detail": problem,
                         "seconds": round(seconds, 1)}
        print(f"[{'PASS' if not problem else 'FAIL'}] {name} ({seconds:.0f} s)"
              + (f": {problem}" if problem else ""), flush=True)
    if not args.no_bench and device == "cuda":
        try:
            step_bench(args.bench_numel)
        except Exception as error:
            print(f"[INFO] speed table failed: {type(error).__name__}: {error}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": where, "torch": torch.__version__, "triton": triton.__version__,
                       "large_chunk": chunk, "steps": results}, f, indent=2)
    failed = [name for name, r in results.items() if r["status"] == "FAIL"]
    print("SUMMARY:", "PASS" if not failed else "FAIL (" + ", ".join(failed) + ")")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
