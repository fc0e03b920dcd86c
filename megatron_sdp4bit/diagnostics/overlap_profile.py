"""How much of the quantized collectives' work runs beside the backward and forward passes.

    torchrun --nproc-per-node 4 -m megatron_sdp4bit.diagnostics.overlap_profile \\
        --profile-after 4 --profile-steps 3 --json FILE -- <the driver's flags, with
        --overlap-grad-reduce --overlap-param-gather and a --bucket-size of several buckets>

Trains with the driver (``megatron_sdp4bit.pretrain``) and, on rank 0, profiles
``--profile-steps`` steps after iteration ``--profile-after`` with ``torch.profiler``:

- on a GPU, every kernel of the process on every stream (CUPTI): the share of the
  time of the quantization kernels (``quantize_kernel``, ``dequantize_kernel``) off
  the compute stream (the runner's side stream) during which a kernel of the
  compute stream (the backward's, the forward's, the optimizer's) runs too. Also
  reported: the quantization time on the compute stream itself (error sampling, or
  a collective not moved off it: never beside the passes), how busy the compute
  stream was (the share a kernel landing at random would overlap), and a table of
  the streams;
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


def _stream(event: dict):
    return event.get("args", {}).get("stream")


def _is_quantization(event: dict) -> bool:
    return any(k in event["name"] for k in QUANTIZATION_KERNELS)


def compute_stream(kernels: Sequence[dict]):
    """The stream the backward and forward passes run on: the one with the most kernel
    time that is neither quantization nor NCCL (the collectives' own)."""
    time_on: dict = {}
    for e in kernels:
        if not _is_quantization(e) and not e["name"].lower().startswith("nccl"):
            time_on[_stream(e)] = time_on.get(_stream(e), 0.0) + float(e.get("dur", 0.0))
    return max(time_on, key=time_on.get) if time_on else None


def kernel_spans(events: Sequence[dict]) -> Tuple[List[Interval], List[Interval], List[Interval]]:
    """(quantization kernels off the compute stream, quantization kernels on it, the
    compute stream's other kernels) of a CUDA trace, in microseconds.

    The first are the collectives' work moved off the compute path (a runner's side
    stream); the second are not (the layer's error sampling, or a collective that ran on
    the caller), so they can never run beside the passes and are reported apart."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    compute = compute_stream(kernels)
    off = [_span(e) for e in kernels if _is_quantization(e) and _stream(e) != compute]
    on = [_span(e) for e in kernels if _is_quantization(e) and _stream(e) == compute]
    passes = [_span(e) for e in kernels if not _is_quantization(e) and _stream(e) == compute]
    return off, on, passes


def stream_table(events: Sequence[dict]) -> dict:
    """Per stream: kernels, their seconds, and how many of them and seconds are
    quantization kernels (what the profile saw, to read a surprising share against)."""
    table: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            row = table.setdefault(str(_stream(e)), dict(kernels=0, seconds=0.0,
                                                         quantization_kernels=0,
                                                         quantization_seconds=0.0))
            row["kernels"] += 1
            row["seconds"] += float(e.get("dur", 0.0)) / 1e6
            if _is_quantization(e):
                row["quantization_kernels"] += 1
                row["quantization_seconds"] += float(e.get("dur", 0.0)) / 1e6
    return table


def busy_fraction(spans: Sequence[Interval]) -> Optional[float]:
    """The share of the time from the first span's start to the last one's end during
    which some span runs: what a kernel landing at random in that time would overlap."""
    merged = _merged(spans)
    if not merged:
        return None
    whole = merged[-1][1] - merged[0][0]
    return sum(end - start for start, end in merged) / whole if whole > 0 else None


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
            off, on, passes = kernel_spans(events)
            total, overlapped = covered(off, passes)
            return {"mode": "cuda kernels", "steps": self.steps, "quantized_s": total / 1e6,
                    "overlapped_s": overlapped / 1e6, "intervals": len(off),
                    "share": overlapped / total if total else None,
                    "on_compute_stream_s": sum(end - start for start, end in _merged(on)) / 1e6,
                    "compute_busy": busy_fraction(passes), "streams": stream_table(events)}
        workers = [t.native_id for t in threading.enumerate() if t.name == WORKER_THREAD]
        quant, other = thread_spans(events, workers[0] if workers else -1,
                                    threading.main_thread().native_id)
        total, overlapped = covered(quant, other)
        return {"mode": "cpu threads", "steps": self.steps, "quantized_s": total / 1e6,
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
    if result.get("mode") == "cuda kernels":
        busy = result["compute_busy"]
        print(f"overlap profile: compute stream busy {'-' if busy is None else f'{busy:.1%}'} of "
              f"its span; {result['on_compute_stream_s']:.4f} s of quantization kernels ran on the "
              f"compute stream itself; streams {json.dumps(result['streams'])}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0 if share is not None else 1


if __name__ == "__main__":
    sys.exit(main())
