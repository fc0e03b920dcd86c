"""How much of the quantized collectives' work runs beside the backward and forward passes.

    torchrun --nproc-per-node 4 -m megatron_sdp4bit.diagnostics.overlap_profile \\
        --profile-after 4 --profile-steps 3 --json FILE -- <the driver's flags, with
        --overlap-grad-reduce --overlap-param-gather and a --bucket-size of several buckets>

Trains with the driver (``megatron_sdp4bit.pretrain``) and, on rank 0, profiles
``--profile-steps`` steps after iteration ``--profile-after`` with ``torch.profiler``:

- on a GPU, every kernel of the process on every stream (CUPTI): the share of the
  quantization kernels' time (``quantize_kernel``, ``dequantize_kernel``) during
  which another kernel (the backward's or the forward's) runs too;
- on CPU (``scripts/gpu_check.sh --cpu-smoke``), every thread's operators: the share
  of the collectives' worker thread's operator time during which the main thread
  runs an operator.

Prints one line and writes ``--json``: the share, the seconds behind it, the counts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

Interval = Tuple[float, float]
WORKER_THREAD = "sdp4bit-collectives"  # comm.runner.ThreadRunner's worker
QUANTIZATION_KERNELS = ("quantize_kernel",)  # a substring of both kernels' names


def _merged(intervals: Iterable[Interval]) -> List[Interval]:
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(targets: Sequence[Interval], others: Iterable[Interval]) -> Tuple[float, float]:
    """(total length of ``targets``, the part of it during which some ``others`` runs)."""
    union = _merged(others)
    total = overlapped = 0.0
    first = 0  # both lists are sorted and disjoint: one pass over each
    for start, end in _merged(targets):
        total += end - start
        while first < len(union) and union[first][1] <= start:
            first += 1
        for other_start, other_end in union[first:]:
            if other_start >= end:
                break
            overlapped += min(end, other_end) - max(start, other_start)
    return total, overlapped


def _span(event: dict) -> Interval:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


def kernel_spans(events: Sequence[dict]) -> Tuple[List[Interval], List[Interval]]:
    """(quantization kernels, every other kernel) of a CUDA trace, in microseconds."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    quant = [_span(e) for e in kernels if any(k in e["name"] for k in QUANTIZATION_KERNELS)]
    quant_streams = {e.get("args", {}).get("stream") for e in kernels
                     if any(k in e["name"] for k in QUANTIZATION_KERNELS)}
    # the rest of the step: not the collectives' own (NCCL) kernels, not their stream's
    other = [_span(e) for e in kernels
             if not any(k in e["name"] for k in QUANTIZATION_KERNELS)
             and not e["name"].lower().startswith("nccl")
             and e.get("args", {}).get("stream") not in quant_streams]
    return quant, other


def thread_spans(events: Sequence[dict], worker_tid: int,
                 main_tid: int) -> Tuple[List[Interval], List[Interval]]:
    """(the worker thread's operators, the main thread's operators) of a CPU trace."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    return ([_span(e) for e in ops if e.get("tid") == worker_tid],
            [_span(e) for e in ops if e.get("tid") == main_tid])


def _profiler() -> "torch.profiler.profile":
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:  # the worker thread existed before the profiler started: record every thread
        from torch._C._profiler import _ExperimentalConfig

        config = _ExperimentalConfig(profile_all_threads=True)
        return torch.profiler.profile(activities=activities, experimental_config=config)
    except (ImportError, TypeError):
        return torch.profiler.profile(activities=activities)


class _Window:
    """Starts the profiler after iteration ``after`` and measures ``steps`` steps (rank 0)."""

    def __init__(self, after: int, steps: int) -> None:
        self.after, self.steps = after, steps
        self.profiler = None
        self.result: Optional[dict] = None

    def __call__(self, run) -> None:
        if torch.distributed.get_rank() != 0:
            return
        if run.iteration == self.after:
            self.profiler = _profiler()
            self.profiler.start()
        elif self.profiler is not None and run.iteration == self.after + self.steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.stop()
            self.result = self._measure(self.profiler)
            self.profiler = None

    def _measure(self, profiler) -> dict:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            profiler.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        if torch.cuda.is_available():
            mode, (quant, other) = "cuda kernels", kernel_spans(events)
        else:
            workers = [t.native_id for t in threading.enumerate() if t.name == WORKER_THREAD]
            mode = "cpu threads"
            quant, other = thread_spans(events, workers[0] if workers else -1,
                                        threading.main_thread().native_id)
        total, overlapped = covered(quant, other)
        return {"mode": mode, "steps": self.steps, "quantized_s": total / 1e6,
                "overlapped_s": overlapped / 1e6, "intervals": len(quant),
                "share": overlapped / total if total else None}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, driver = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile-after", type=int, default=4, help="iterations before profiling")
    parser.add_argument("--profile-steps", type=int, default=3, help="iterations profiled")
    parser.add_argument("--json", default=None, help="write the result here (rank 0)")
    args = parser.parse_args(own)
    from megatron_sdp4bit.pretrain import run
    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.distributed import shutdown

    driver_args = parse_args(driver)
    if driver_args.train_iters < args.profile_after + args.profile_steps:
        parser.error(f"--train-iters {driver_args.train_iters} ends before the profiled steps "
                     f"({args.profile_after} + {args.profile_steps})")
    window = _Window(args.profile_after, args.profile_steps)
    try:
        run(driver_args, on_step=window)
        rank = torch.distributed.get_rank()
    finally:
        shutdown()
    if rank != 0:
        return 0
    result = window.result or {"share": None}
    share = result["share"]
    print(f"overlap profile: {'no quantized work seen' if share is None else f'{share:.1%}'} of "
          f"the quantized collectives' {result.get('mode', '')} time ran beside the backward and "
          f"forward passes ({result.get('overlapped_s', 0):.3f} of {result.get('quantized_s', 0):.3f} "
          f"s over {args.profile_steps} steps)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0 if share is not None else 1


if __name__ == "__main__":
    sys.exit(main())
