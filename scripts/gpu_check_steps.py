#!/usr/bin/env python
"""The steps of scripts/gpu_check.sh: run each, print PASS/FAIL/SKIP, write a JSON.

    python scripts/gpu_check_steps.py --out DIR [--cpu-smoke] [--steps env,triton,...]

Steps (docs/gpu_check.md says what each checks):
  env          GPU, driver, torch/CUDA/Triton/Python, megatron-core, Apex, Transformer Engine
  triton       compile + tests + dispatch of the Triton kernels (scripts/gpu_check_triton.py)
  large        the ~33M-element bit-identity check of the kernels against the reference
  nccl         with 2 or more GPUs (else SKIP with the reason): one NCCL rank per GPU, the
               quantized collectives against the CPU reference and the exact sums
               (megatron_sdp4bit.diagnostics.device_collectives --backend nccl)
  bench        the kernel speed table (scripts/bench_quant.py)
  dp4          4 data-parallel ranks on the one GPU over gloo (2 emulated nodes x 2): the
               quantized collectives on CUDA against the CPU reference (the async ones on a
               worker thread with its side stream; then on the deferring runner; then on
               NCCL's side-stream runner), then the driver with
               --overlap-grad-reduce --overlap-param-gather and several buckets, SDP4Bit (on
               NCCL's runner, --sdp4bit-runner stream) and exact side by side, replicas
               checked every step
  overlap      the same 4 ranks, SDP4Bit overlapped: 3 steps profiled (torch.profiler), the
               share of the quantization kernels' time that runs beside other kernels
               (megatron_sdp4bit.diagnostics.overlap_profile; target >= 0.8)
  train        the driver, 125M GPT on one GPU, presets sdp4bit / baseline, step times
  megatron_lm  Megatron-LM's pretrain_gpt.py via the launcher and via the patch
               (only with MEGATRON_LM_PATH at a core_v0.16.1 checkout)

``--cpu-smoke`` runs the same logic on CPU with tiny sizes (the self-test that
tests/scripts/test_gpu_check.py runs). Each step runs its work in a subprocess
with a time limit, so one crash or hang is one FAIL, not the end of the check; a
step the budget (``--budget-s``) leaves no time for is reported SKIP, "not run
(budget)", and the steps run in the order of what a GPU has not yet shown.
Only small files go to --out (the device tool returns at most 8); everything
else goes to a work folder (--work, default a fresh temporary folder).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a GPU has not shown yet first: the quantized path at DP>1 on CUDA and its overlap,
# then the kernels' speed and the DP=1 overhead.
STEPS = ("env", "triton", "large", "nccl", "dp4", "hosts", "overlap", "bench", "train", "megatron_lm")
OVERLAP_TARGET = 0.8  # share of the quantization kernels' time beside other kernels'
OVERLAP_PROFILE = dict(after=4, steps=3)
# zeropp at DP=1 takes the same path as sdp4bit (one rank: nothing is quantized)
PRESETS = ("sdp4bit", "baseline")
DP4_PRESETS = ("sdp4bit", "baseline")
DP4_LOSS_TOLERANCE = 0.01  # the CPU accuracy study's criterion (docs/results.md): within 1%
RATIO_TARGET = 1.02  # sdp4bit step time / baseline step time
CORPUS_FILES = ("tokenizer.json", "stdlib_text_document.bin", "stdlib_text_document.idx")

# The paper's 125M shape (seq 1024 here) on one GPU; and a tiny one for the CPU self-test.
GPU_TRAIN = dict(layers=12, hidden=768, heads=12, seq=1024, micro_batch=8, iters=40,
                 log_interval=10, warmup_iters=20)
CPU_TRAIN = dict(layers=2, hidden=64, heads=4, seq=64, micro_batch=2, iters=4,
                 log_interval=1, warmup_iters=2)
# 4 ranks on one GPU over gloo (every collective through host memory): a small model, in
# buckets of bucket_size parameters (17 M parameters: 5 buckets), overlapped.
GPU_DP4 = dict(layers=4, hidden=512, heads=8, seq=512, micro_batch=4, iters=20,
               log_interval=5, warmup_iters=10, shard=1 << 18, bucket_size=4_000_000)
CPU_DP4 = dict(CPU_TRAIN, iters=8, shard=3000, bucket_size=40_000)
DP4_COLLECTIVES = ("dp4.collectives", "dp4.collectives.deferred", "dp4.collectives.stream")
# SDP4Bit's dp4 run puts its overlapped collectives on the runner the layer takes on NCCL,
# through megatron (--sdp4bit-runner stream; gloo's own, the worker thread, runs in the hosts
# and overlap steps). The CPU self-test has no CUDA stream: the deferring runner there.
DP4_RUNNER = {"gpu": "stream", "smoke": "deferred"}
# the stream runner's check: a shard whose kernels outlast their launch, so a read before
# the side stream is done shows (the unaligned 4101 runs too)
STREAM_SHARD = 1 << 16
# The overlap profile needs a compute stream with work on it: dp4's model leaves the GPU
# idle between launches (66 ms/step for 17 M parameters on the first H200 run), so a
# quantization kernel finds no backward kernel beside it whatever the schedule. 16 K
# tokens per rank on 60 M parameters in 6 buckets keep the passes' kernels long.
GPU_OVERLAP = dict(GPU_DP4, layers=4, hidden=1024, heads=16, seq=1024, micro_batch=16,
                   bucket_size=10_000_000)
OVERLAP_FLAGS = ["--overlap-grad-reduce", "--overlap-param-gather"]
# 2 emulated hosts x 2 ranks (megatron_sdp4bit.emulated_hosts), dp4's model with experts:
# expert-parallel 2, so each expert-data-parallel group holds one rank of each host
EXPERT_FLAGS = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2"]
EXPERT_RATIO_TOLERANCE = 0.05  # issue 27: an MoE run's bytes ratio within 0.05 of the dense run's


# --- results -----------------------------------------------------------------------

class Report:
    """Every step's outcome: printed as it happens, kept for the summary and the JSON."""

    def __init__(self) -> None:
        self.results: List[dict] = []

    def add(self, name: str, status: str, detail: str = "", seconds: float = 0.0, **data) -> None:
        assert status in ("PASS", "FAIL", "SKIP"), status
        self.results.append(dict(name=name, status=status, detail=detail,
                                 seconds=round(seconds, 1), **data))
        print(f"[{status}] {name} ({seconds:.0f} s)" + (f": {detail}" if detail else ""), flush=True)

    def failed(self) -> List[str]:
        return [r["name"] for r in self.results if r["status"] == "FAIL"]

    def summary(self) -> str:
        counts = {s: sum(r["status"] == s for r in self.results) for s in ("PASS", "FAIL", "SKIP")}
        lines = ["", "=== gpu_check summary ==="]
        lines += [f"  {r['status']:4s}  {r['name']:22s} {r['detail']}".rstrip() for r in self.results]
        lines.append(f"SUMMARY: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
                     f" -> {'FAIL (' + ', '.join(self.failed()) + ')' if self.failed() else 'PASS'}")
        return "\n".join(lines)


def run_logged(cmd: List[str], timeout: float, env: Optional[dict] = None,
               cwd: str = ROOT) -> tuple:
    """Run ``cmd``, streaming its output indented; ``(exit status, output)``.

    The exit status is None when it ran past ``timeout`` seconds (it is killed).
    """
    print("    $ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            process_group=0)  # its own group: a kill reaches its children
    killed = []

    def kill():
        killed.append(True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            print("    | " + line, end="", flush=True)
        proc.wait()
    finally:
        timer.cancel()
    if killed:
        print(f"    (killed after {timeout:.0f} s)", flush=True)
    return (None if killed else proc.returncode), "".join(lines)


def time_limit(ctx: dict, seconds: float) -> float:
    """``seconds``, cut to what is left of the whole check's budget (--budget-s), so the
    summary and the JSON are written before the device tool's own limit ends the command."""
    return max(1.0, min(seconds, ctx["deadline"] - time.time() - 15))


def run_limited(ctx: dict, cmd: List[str], seconds: float, env: Optional[dict] = None,
                cwd: str = ROOT) -> tuple:
    """``run_logged`` under a limit of ``seconds`` cut to the budget: ``(exit status,
    output, cut)``. ``cut`` (for ``killed``): the budget left the step under half its own
    limit, too little to tell a slow step from a hung one; a step cut less and still
    killed had most of its time, and hung or is too slow (FAIL)."""
    limit = time_limit(ctx, seconds)
    if limit < seconds:
        print(f"    (time limit cut from {seconds:.0f} s to {limit:.0f} s by the budget)", flush=True)
    rc, output = run_logged(cmd, timeout=limit, env=env, cwd=cwd)
    return rc, output, limit < 0.5 * seconds


def killed(cut: bool) -> tuple:
    """(status, detail) of a step whose command was killed at its limit: a limit the
    budget cut is the budget's doing, not a failure of what the step checks."""
    if cut:
        return "SKIP", "not run to the end (budget): the check's time budget cut it short"
    return "FAIL", "timed out"


def python_env(**changes) -> dict:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(changes)
    return env


# --- (a) environment -----------------------------------------------------------------

def probe_package(dist_name: str, module: str) -> dict:
    """Is ``module`` importable (found, not imported: importing Apex or Transformer Engine
    can be slow or crash), and which version of ``dist_name`` is installed?"""
    error = None
    try:
        present = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is not installed
        present = False
    except (ImportError, ValueError) as exc:  # a parent package that fails to import
        present, error = False, f"is not importable: {type(exc).__name__}: {exc}"
    version = None
    if present:
        try:
            version = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    out = {"present": present, "version": version}
    if error:
        out["error"] = error
    return out


OPTIONAL = {"Apex": ("apex", "apex"), "Transformer Engine": ("transformer_engine", "transformer_engine")}


def gpu_driver() -> str:
    if not shutil.which("nvidia-smi"):
        return "n/a (no nvidia-smi)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() \
            else f"n/a (nvidia-smi exit {out.returncode})"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"n/a ({type(exc).__name__})"


def collect_environment() -> dict:
    info = {"python": platform.python_version(), "executable": sys.executable,
            "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.version.cuda,
                    cuda_available=torch.cuda.is_available(),
                    gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            info.update(gpu=torch.cuda.get_device_name(), capability=f"sm_{major}{minor}",
                        gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    except ImportError as exc:
        info["torch"] = None
        info["torch_error"] = str(exc)
    info["driver"] = gpu_driver()
    info["triton"] = probe_package("triton", "triton")["version"]
    info["megatron_core"] = mcore = probe_package("megatron-core", "megatron.core")
    if mcore["present"]:  # required, and safe to import: say so now if it is broken
        try:
            importlib.import_module("megatron.core")
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            mcore.update(present=False, error=f"import fails: {type(exc).__name__}: {exc}")
    info["optional"] = {name: probe_package(*names) for name, names in OPTIONAL.items()}
    info["wheels"] = os.environ.get("GPU_CHECK_WHEELS", "not looked for")
    return info


def step_env(report: Report, ctx: dict) -> None:
    start = time.perf_counter()
    info = collect_environment()
    ctx["env"] = info
    optional = ", ".join(f"{name} {p['version'] if p['present'] else 'absent'}"
                         for name, p in info["optional"].items())
    mcore = info["megatron_core"]
    print(f"    python {info['python']} ({info['executable']}), torch {info.get('torch')}, "
          f"CUDA {info.get('cuda')}, triton {info['triton']}")
    print(f"    GPU {info.get('gpu', 'none')} {info.get('capability', '')}, driver {info['driver']}")
    print(f"    megatron-core {mcore['version'] if mcore['present'] else mcore.get('error', 'absent')}; {optional}; "
          f"wheels: {info['wheels']}")
    problems = []
    if not info.get("torch"):
        problems.append("torch does not import")
    if not mcore["present"]:
        problems.append("megatron-core " + mcore["error"] if mcore.get("error") else
                        "megatron-core is missing (carry its wheel: scripts/gpu_check_prepare.sh)")
    if not ctx["smoke"] and not info.get("cuda_available"):
        problems.append("torch sees no CUDA device")
    if info["triton"] is None:
        problems.append("triton is missing")
    detail = "; ".join(problems) or (
        f"{info.get('gpu', 'CPU')}, driver {info['driver']}, torch {info.get('torch')}, "
        f"megatron-core {mcore['version']}, {optional}")
    report.add("env", "FAIL" if problems else "PASS", detail, time.perf_counter() - start)


# --- (b), (c) Triton kernels --------------------------------------------------------------

def step_triton(report: Report, ctx: dict) -> None:
    """compile/tests/dispatch (b) and large (c), in one subprocess of gpu_check_triton.py."""
    wanted = []
    if "triton" in ctx["steps"]:
        wanted += ["compile", "tests", "dispatch"]
    if "large" in ctx["steps"]:
        wanted.append("large")
    names = {"compile": "triton.compile", "tests": "triton.tests", "dispatch": "triton.dispatch",
             "large": "large"}
    if ctx["env"].get("triton") is None:
        for sub in wanted:
            report.add(names[sub], "SKIP", "triton is not installed")
        return
    out_json = os.path.join(ctx["work"], "triton.json")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu_check_triton.py"), "--no-bench",
           "--device", "cpu" if ctx["smoke"] else "cuda", "--steps", ",".join(wanted),
           "--json", out_json]
    start = time.perf_counter()
    # The self-test's interpreter runs take about 70 s alone on 2 cores, and past 120 s
    # beside another test suite (seen: compile 11 s, then killed at 120 s).
    rc, output, cut = run_limited(ctx, cmd, 240, env=python_env())
    results = {}
    if os.path.isfile(out_json):
        with open(out_json, encoding="utf-8") as f:
            results = json.load(f).get("steps", {})
    for sub in wanted:
        r = results.get(sub)
        if r is None:
            status, why = killed(cut) if rc is None else (
                "FAIL", f"gpu_check_triton.py exit {rc} before this step")
            report.add(names[sub], status, why, time.perf_counter() - start)
        else:
            report.add(names[sub], r["status"], r["detail"], r["seconds"])


# --- (d) kernel speed table ---------------------------------------------------------------

def step_bench(report: Report, ctx: dict) -> None:
    script = os.path.join(ROOT, "scripts", "bench_quant.py")
    if not os.path.isfile(script):
        report.add("bench", "SKIP", "scripts/bench_quant.py is missing")
        return
    with open(script, encoding="utf-8") as f:
        has_json = re.search(r"""["']--json["']""", f.read()) is not None
    out_json = os.path.join(ctx["out"], "bench_quant.json")
    cmd = [sys.executable, script, "--device", "cpu" if ctx["smoke"] else "cuda"]
    if ctx["smoke"]:
        cmd += ["--sizes", "0.25", "--repeats", "1"]
    if has_json:
        cmd += ["--json", out_json]
    start = time.perf_counter()
    rc, output, cut = run_limited(ctx, cmd, 60 if ctx["smoke"] else 150, env=python_env())
    seconds = time.perf_counter() - start
    table = [line for line in output.splitlines() if line.startswith("|")]
    if rc != 0:
        report.add("bench", *(killed(cut) if rc is None else ("FAIL", f"bench_quant.py exit {rc}")),
                   seconds)
    elif not table and not (has_json and os.path.isfile(out_json)):
        report.add("bench", "FAIL", "bench_quant.py printed no table and wrote no JSON", seconds)
    else:
        note = f"table in the log, {out_json.rsplit(os.sep, 1)[-1]}" if has_json and os.path.isfile(
            out_json) else "table in the log (this bench_quant.py has no --json)"
        report.add("bench", "PASS", note, seconds, table=table)


# --- (e) the training driver --------------------------------------------------------------

def find_corpus(ctx: dict) -> tuple:
    """``(folder with the corpus files, how it was found)``: the carried one, else built now."""
    carried = os.environ.get("GPU_CHECK_CORPUS") or os.path.join(ROOT, ".gpu_carry", "corpus")
    if all(os.path.isfile(os.path.join(carried, name)) for name in CORPUS_FILES):
        return carried, f"carried corpus {carried}"
    from megatron_sdp4bit.data.corpus import prepare_default_corpus

    max_mb = 0.5 if ctx["smoke"] else 4
    start = time.perf_counter()
    prefix = prepare_default_corpus(cache_dir=os.path.join(ctx["work"], "corpus-cache"), max_mb=max_mb)
    return os.path.dirname(prefix), (f"no carried corpus at {carried}: built a {max_mb:g} MB one in "
                                     f"{time.perf_counter() - start:.0f} s")


def corpus_or_fail(report: Report, ctx: dict, step: str) -> Optional[str]:
    """The corpus folder (``find_corpus``), or None with ``step`` reported FAIL."""
    try:
        corpus, how = find_corpus(ctx)
    except Exception as exc:  # noqa: BLE001 - reported, the other steps go on
        report.add(step, "FAIL", f"no corpus: {type(exc).__name__}: {exc}")
        return None
    print(f"    {how}")
    return corpus


def driver_corpus(report: Report, ctx: dict, step: str) -> Optional[str]:
    """The corpus folder for a step that runs the driver, or None with ``step`` reported:
    SKIP without megatron-core, FAIL without a corpus."""
    if not ctx["env"]["megatron_core"]["present"]:
        report.add(step, "SKIP", "megatron-core is missing")
        return None
    return corpus_or_fail(report, ctx, step)


def train_command(preset_name: str, shape: dict, corpus: str, work: str,
                  launcher: Optional[List[str]] = None, dp: int = 1, run_name: str = "") -> List[str]:
    """The driver on ``shape`` (``recipes.gpu_check_recipe``); ``launcher`` (torchrun) for
    ``dp`` ranks, else one process."""
    from megatron_sdp4bit.recipes import gpu_check_recipe

    recipe = gpu_check_recipe(shape["layers"], shape["hidden"], shape["heads"], shape["seq"],
                              shape["micro_batch"], shape["iters"], shape["log_interval"], dp)
    run_dir = os.path.join(work, run_name or f"train-{preset_name}")
    return (launcher or [sys.executable]) + [
        "-m", "megatron_sdp4bit.pretrain", "--sdp4bit-preset", preset_name, *recipe.flags(),
        "--data-path", os.path.join(corpus, "stdlib_text_document"),
        "--tokenizer-type", "StdlibBPETokenizer",
        "--tokenizer-model", os.path.join(corpus, "tokenizer.json"),
        "--data-cache-path", os.path.join(work, "dataset-cache"),
        "--run-dir", run_dir, "--no-progress-bar",
    ]


def steady_step_time(records: List[dict], warmup_iters: int) -> Optional[float]:
    """Median ``step_time_s`` of the log windows that end after ``warmup_iters``."""
    times = [r["step_time_s"] for r in records
             if r.get("kind") == "train" and r["iteration"] > warmup_iters]
    return statistics.median(times) if times else None


def run_training(report: Report, ctx: dict, label: str, cmd: List[str], shape: dict,
                 run_name: str, timeout: float, keep_metrics: bool = True) -> tuple:
    """Run the driver, report ``label`` PASS/FAIL; ``(row of figures, its output)``.
    ``keep_metrics``: its metrics.jsonl goes to --out (which holds 8 files at most)."""
    start = time.perf_counter()
    rc, output, cut = run_limited(ctx, cmd, timeout, env=python_env())
    seconds = time.perf_counter() - start
    from megatron_sdp4bit.training.metrics import read_metrics

    metrics = os.path.join(ctx["work"], run_name, "metrics.jsonl")
    records = read_metrics(metrics) if os.path.isfile(metrics) else []
    if records and keep_metrics:
        shutil.copy(metrics, os.path.join(ctx["out"], f"{run_name}.jsonl"))
    train = [r for r in records if r.get("kind") == "train"]
    step = steady_step_time(records, shape["warmup_iters"])
    loss = train[-1]["loss"] if train else math.nan
    row = dict(step_time_s=step, final_loss=loss,
               tokens_per_s=(shape["micro_batch"] * shape["seq"] / step) if step else None,
               bytes_sent=sum(r.get("bytes_sent") or 0 for r in train),
               bytes_exact=sum(r.get("bytes_exact") or 0 for r in train))
    if rc != 0:
        report.add(label, *(killed(cut) if rc is None else ("FAIL", f"driver exit {rc}")), seconds,
                   **row)
    elif not train or train[-1]["iteration"] != shape["iters"] or not math.isfinite(loss):
        report.add(label, "FAIL", f"metrics.jsonl: {len(train)} windows, last loss {loss}",
                   seconds, **row)
    else:
        report.add(label, "PASS", f"{shape['iters']} iterations, loss {loss:.4f}, "
                   f"{step * 1e3:.1f} ms/step after iteration {shape['warmup_iters']}", seconds, **row)
        row["passed"] = True
    return row, output


def step_train(report: Report, ctx: dict) -> None:
    shape = CPU_TRAIN if ctx["smoke"] else GPU_TRAIN
    if not ctx["env"]["megatron_core"]["present"]:
        for name in PRESETS:
            report.add(f"train.{name}", "SKIP", "megatron-core is missing")
        return
    corpus = corpus_or_fail(report, ctx, "train")
    if corpus is None:
        return
    rows = {}
    for name in PRESETS:
        rows[name], _ = run_training(report, ctx, f"train.{name}",
                                     train_command(name, shape, corpus, ctx["work"]), shape,
                                     f"train-{name}", 90 if ctx["smoke"] else 180)
    print(f"\n    step time, median of the log windows after iteration {shape['warmup_iters']} "
          f"(GPT {shape['layers']}x{shape['hidden']}, seq {shape['seq']}, micro-batch "
          f"{shape['micro_batch']}, DP=1):")
    print(f"    {'preset':10s} {'ms/step':>9s} {'tokens/s':>10s} {'final loss':>11s}")
    for name, row in rows.items():
        ms = f"{row['step_time_s'] * 1e3:9.1f}" if row["step_time_s"] else f"{'-':>9s}"
        tps = f"{row['tokens_per_s']:10.0f}" if row["tokens_per_s"] else f"{'-':>10s}"
        print(f"    {name:10s} {ms} {tps} {row['final_loss']:11.4f}")
    base, ours = rows.get("baseline", {}).get("step_time_s"), rows.get("sdp4bit", {}).get("step_time_s")
    if not (base and ours):
        report.add("train.ratio", "SKIP", "sdp4bit or baseline did not run")
        return
    ratio = ours / base
    print(f"    sdp4bit / baseline = {ratio:.4f} (target <= {RATIO_TARGET})\n", flush=True)
    detail = f"sdp4bit/baseline step time {ratio:.4f} (target <= {RATIO_TARGET})"
    if ctx["smoke"]:
        report.add("train.ratio", "SKIP", detail + "; CPU self-test: timings are not the target",
                   ratio=ratio)
    else:
        report.add("train.ratio", "PASS" if ratio <= RATIO_TARGET else "FAIL", detail, ratio=ratio)


# --- (f) 4 data-parallel ranks on one GPU --------------------------------------------------

REPLICA_CHECKS = re.compile(r"replica checks\s+(\d+) passed")


def torchrun(ranks: int) -> List[str]:
    from megatron_sdp4bit.jobs import torchrun_command

    return torchrun_command(ranks)


def collectives_check(report: Report, ctx: dict, name: str, cmd: List[str], out_json: str,
                      limit_s: float, **env_changes: str) -> None:
    """Run megatron_sdp4bit.diagnostics.device_collectives (``cmd``, writing ``out_json``,
    with ``env_changes`` in its environment) and report its cases as step ``name``."""
    start = time.perf_counter()
    rc, _, cut = run_limited(ctx, cmd, limit_s, env=python_env(**env_changes))
    cases = []
    if os.path.isfile(out_json):
        with open(out_json, encoding="utf-8") as f:
            cases = json.load(f)["cases"]
    failed = [c for c in cases if not c["passed"]]
    status = "FAIL"
    if rc is None:
        status, detail = killed(cut)
    elif not cases:
        detail = f"exit {rc}, no results"
    elif failed:
        detail = f"{len(failed)} of {len(cases)} cases fail, e.g. {failed[0]['collective']} {failed[0]['case']}"
    else:
        detail = (f"{len(cases)} cases: nearest rounding bit-identical to the CPU reference, "
                  "stochastic within the stated bound, async bit-identical to sync, "
                  "weight replicas identical")
        if any("side_stream_outranks_compute" in c for c in cases):
            detail += ", the runner's side stream outranks the compute stream"
    ok = rc == 0 and cases and not failed
    bounds = [c["bound_ratio"] for c in cases if c["bound_ratio"] is not None]
    report.add(name, "PASS" if ok else status, detail, time.perf_counter() - start,
               worst_bound_ratio=max(bounds, default=None))


def dp4_collectives(report: Report, ctx: dict, shape: dict) -> None:
    """4 gloo ranks (2 emulated nodes x 2) on the one GPU: every collective on CUDA tensors
    against the CPU reference (megatron_sdp4bit.diagnostics.device_collectives)."""
    out_json = os.path.join(ctx["out"], "device_collectives.json")
    cmd = torchrun(4) + ["-m", "megatron_sdp4bit.diagnostics.device_collectives",
                         "--device", "cpu" if ctx["smoke"] else "cuda", "--ranks-per-node", "2",
                         "--backend", "gloo", "--levels", "2",
                         "--shard", str(shape["shard"]), "--json", out_json]
    collectives_check(report, ctx, "dp4.collectives", cmd, out_json, 90 if ctx["smoke"] else 150)
    # the runner the layer takes on NCCL under CUDA_DEVICE_MAX_CONNECTIONS=1, on the same
    # ranks: its stages on its side stream, in the caller's order (small shards: the order
    # is what is checked; its JSON stays in the work folder, $OUT holds 8 files at most)
    out_json = os.path.join(ctx["work"], "device_collectives_deferred.json")
    cmd = torchrun(4) + ["-m", "megatron_sdp4bit.diagnostics.device_collectives",
                         "--device", "cpu" if ctx["smoke"] else "cuda", "--ranks-per-node", "2",
                         "--backend", "gloo", "--levels", "2", "--runner", "deferred",
                         "--shard", "4101", "--json", out_json]
    collectives_check(report, ctx, "dp4.collectives.deferred", cmd, out_json, 60)
    # the runner the layer takes on NCCL (a side stream), on the same gloo ranks: one GPU
    # cannot host two NCCL ranks, but gloo's CUDA staging follows the caller's stream, so
    # the runner's stream order is checked on a real device
    if ctx["smoke"]:
        report.add("dp4.collectives.stream", "SKIP",
                   "CPU self-test: the stream runner's side stream is a CUDA stream")
        return
    out_json = os.path.join(ctx["work"], "device_collectives_stream.json")
    cmd = cmd[:cmd.index("--runner")] + ["--runner", "stream", "--shard", str(STREAM_SHARD),
                                         "--json", out_json]
    collectives_check(report, ctx, "dp4.collectives.stream", cmd, out_json, 90)  # not timed yet


# --- (e0) the NCCL self-check: one rank per GPU -----------------------------------------

def nccl_skip_reason(ctx: dict) -> Optional[str]:
    """Why the NCCL self-check cannot run here (None: it can)."""
    if ctx["smoke"]:
        return "CPU self-test: NCCL needs 2 or more GPUs (its refusals are tested on CPU)"
    gpus = ctx["env"].get("gpus", 0)
    if gpus < 2:
        return (f"{gpus} GPU visible: NCCL needs 2 or more, one per rank "
                "(dp4.collectives checks the collectives over gloo)")
    return None


def step_nccl(report: Report, ctx: dict) -> None:
    """Every visible GPU one NCCL rank: the user's self-check of README's "First run on a
    cluster" (device_collectives --backend nccl, one- and two-level)."""
    reason = nccl_skip_reason(ctx)
    if reason:
        report.add("nccl.collectives", "SKIP", reason)
        return
    out_json = os.path.join(ctx["work"], "nccl_collectives.json")  # $OUT holds 8 files at most
    cmd = torchrun(ctx["env"]["gpus"]) + ["-m", "megatron_sdp4bit.diagnostics.device_collectives",
                                          "--backend", "nccl", "--levels", "both",
                                          "--json", out_json]  # its default shard, 1 M
    collectives_check(report, ctx, "nccl.collectives", cmd, out_json, 120)
    # the runner the layer takes under one hardware queue, on NCCL as a job with tensor
    # parallelism runs it: stages issued at the later calls, buckets in one chunk
    out_json = os.path.join(ctx["work"], "nccl_collectives_deferred.json")
    cmd = cmd[:cmd.index("--json")] + ["--runner", "deferred", "--json", out_json]
    collectives_check(report, ctx, "nccl.collectives.deferred", cmd, out_json, 120,
                      CUDA_DEVICE_MAX_CONNECTIONS="1")


def step_dp4(report: Report, ctx: dict) -> None:
    shape = CPU_DP4 if ctx["smoke"] else GPU_DP4
    if not ctx["env"]["megatron_core"]["present"]:
        for name in DP4_COLLECTIVES + tuple(
                f"dp4.train.{p}" for p in DP4_PRESETS):
            report.add(name, "SKIP", "megatron-core is missing")
        return
    dp4_collectives(report, ctx, shape)
    corpus = corpus_or_fail(report, ctx, "dp4.train")
    if corpus is None:
        return
    rows = {}
    runner = DP4_RUNNER["smoke" if ctx["smoke"] else "gpu"]
    runner_line = f"sdp4bit overlapped collectives: {runner} runner (--sdp4bit-runner)"
    for name in DP4_PRESETS:
        cmd = train_command(name, shape, corpus, ctx["work"], launcher=torchrun(4), dp=4,
                            run_name=f"dp4-{name}") + dp4_flags(shape) + [
            "--sdp4bit-check-interval", "1"]
        if name == "sdp4bit":
            cmd += ["--sdp4bit-runner", runner]
        rows[name], output = run_training(report, ctx, f"dp4.train.{name}", cmd, shape,
                                          f"dp4-{name}", 120 if ctx["smoke"] else 150)
        found = REPLICA_CHECKS.search(output)
        rows[name]["replica_checks"] = int(found.group(1)) if found else 0
        if name == "sdp4bit":
            rows[name]["runner_said"] = runner_line in output
    if rows["sdp4bit"].get("passed") and rows["sdp4bit"]["bytes_exact"]:  # the hosts step's reference
        ctx["dense_wire_ratio"] = rows["sdp4bit"]["bytes_sent"] / rows["sdp4bit"]["bytes_exact"]
    print(f"\n    DP=4 on one {'CPU' if ctx['smoke'] else 'GPU'} over gloo, 2 emulated nodes x 2 "
          f"(GPT {shape['layers']}x{shape['hidden']}, seq {shape['seq']}, {shape['iters']} iterations, "
          f"overlapped, buckets of {shape['bucket_size']} parameters; SDP4Bit's collectives on the "
          f"{runner} runner):")
    print(f"    {'preset':10s} {'ms/step':>9s} {'final loss':>11s} {'replica checks':>15s}")
    for name, row in rows.items():
        ms = f"{row['step_time_s'] * 1e3:9.1f}" if row["step_time_s"] else f"{'-':>9s}"
        print(f"    {name:10s} {ms} {row['final_loss']:11.4f} {row['replica_checks']:15d}")
    sdp, base = rows["sdp4bit"]["final_loss"], rows["baseline"]["final_loss"]
    checks = [rows[name]["replica_checks"] for name in DP4_PRESETS]
    if not (math.isfinite(sdp) and math.isfinite(base)):
        report.add("dp4.loss", "SKIP", "a run did not finish")
        return
    gap = (sdp - base) / base
    problems = [] if abs(gap) <= DP4_LOSS_TOLERANCE else [
        f"SDP4Bit's loss is {gap:+.2%} off the exact run's (tolerance {DP4_LOSS_TOLERANCE:.0%})"]
    if checks != [shape["iters"]] * len(DP4_PRESETS):
        problems.append(f"replica checks {checks}, expected {shape['iters']} each (every step)")
    if not rows["sdp4bit"]["runner_said"]:
        problems.append(f"the SDP4Bit run did not print '{runner_line}'")
    detail = (f"final loss sdp4bit {sdp:.4f} ({runner} runner) vs exact {base:.4f} ({gap:+.2%}, "
              f"tolerance {DP4_LOSS_TOLERANCE:.0%}); replicas bit-identical at every step ({checks})")
    report.add("dp4.loss", "FAIL" if problems else "PASS", "; ".join(problems) or detail,
               loss_gap=gap, replica_checks=checks)


def dp4_flags(shape: dict) -> List[str]:
    """The 4 gloo ranks on one device, 2 emulated nodes x 2, overlapped, several buckets."""
    return ["--distributed-backend", "gloo", "--sdp4bit-ranks-per-node", "2", *OVERLAP_FLAGS,
            "--bucket-size", str(shape["bucket_size"])]


# --- (e'') 2 emulated hosts, experts: the node layout from the hosts, expert bucket groups

HOSTS_PLAN_LINES = (
    "sdp4bit nodes: 2 hosts x 2 ranks (from the hosts)",
    "sdp4bit gradient hops, DP 4: 8-bit inside a node (2 ranks), then 4-bit across nodes (2 ranks)",
    "sdp4bit gradient hops, expert DP 2: 4-bit across nodes (2 ranks)",
    "sdp4bit weight gather, DP 4: 4-bit across nodes (2 ranks), then inside a node (2 ranks)",
)


def hosts_verdict(output: str, row: dict, iters: int, dense_ratio: Optional[float]) -> tuple:
    """(status, detail) of the hosts step's driver run from its output: the nodes learned
    from the hosts (no --sdp4bit-ranks-per-node given), both hops for the dense group and
    the across-nodes hop for the experts', the replica check of both of megatron's
    optimizers every step, and the bytes ratio within 0.05 of dp4's dense run's. With no
    dense run to compare with (dp4 not run, or failed), SKIP: not all was checked."""
    problems = []
    for line in HOSTS_PLAN_LINES:
        if line not in output:
            problems.append(f"no line {line!r}")
    found = REPLICA_CHECKS.search(output)
    checks = int(found.group(1)) if found else 0
    if checks != 2 * iters:
        problems.append(f"replica checks {checks}, expected {2 * iters} (dense and expert optimizer, every step)")
    ratio = row["bytes_sent"] / row["bytes_exact"] if row.get("bytes_exact") else None
    if ratio is None:
        problems.append("no bytes counted")
    elif dense_ratio is not None and abs(ratio - dense_ratio) > EXPERT_RATIO_TOLERANCE:
        problems.append(f"bytes ratio {ratio:.3f} vs the dense run's {dense_ratio:.3f} "
                        f"(tolerance {EXPERT_RATIO_TOLERANCE})")
    if problems:
        return "FAIL", "; ".join(problems)
    detail = (f"2 nodes learned from the hosts, dense DP 4 in two hops, expert DP 2 across "
              f"nodes; {checks} replica checks; {ratio:.3f}x of the exact bytes")
    if dense_ratio is None:
        return "SKIP", detail + " (not compared: dp4's dense SDP4Bit run did not pass)"
    return "PASS", detail + f" (dense dp4 run {dense_ratio:.3f})"


def step_hosts(report: Report, ctx: dict) -> None:
    """dp4's SDP4Bit run with experts, launched as 2 hosts of 2 ranks: each host a torchrun
    node with its own SDP4BIT_HOST_ID (``python -m megatron_sdp4bit.emulated_hosts``), no
    --sdp4bit-ranks-per-node, overlapped, replica check every step."""
    shape = CPU_DP4 if ctx["smoke"] else GPU_DP4
    corpus = driver_corpus(report, ctx, "hosts.moe")
    if corpus is None:
        return
    driver = train_command("sdp4bit", shape, corpus, ctx["work"], dp=4, run_name="hosts-moe")
    entry = driver[driver.index("-m"):]
    cmd = [sys.executable, "-m", "megatron_sdp4bit.emulated_hosts", "--hosts", "2",
           "--ranks-per-host", "2", "--", *entry, "--distributed-backend", "gloo", *OVERLAP_FLAGS,
           "--bucket-size", str(shape["bucket_size"]), *EXPERT_FLAGS, "--sdp4bit-check-interval", "1"]
    row, output = run_training(report, ctx, "hosts.moe.train", cmd, shape, "hosts-moe",
                               120 if ctx["smoke"] else 150, keep_metrics=False)
    if not math.isfinite(row["final_loss"]):
        report.add("hosts.moe", "SKIP", "the run did not finish (hosts.moe.train)")
        return
    status, detail = hosts_verdict(output, row, shape["iters"], ctx.get("dense_wire_ratio"))
    report.add("hosts.moe", status, detail)


def overlap_ranks(ctx: dict) -> tuple:
    """(ranks, their flags) of the overlap profile: one NCCL rank per GPU where there are
    2 or more (2 emulated nodes from 4 GPUs on), else 4 gloo ranks sharing the device."""
    gpus = 0 if ctx["smoke"] else ctx["env"].get("gpus", 0)
    if gpus < 2:
        return 4, dp4_flags(GPU_OVERLAP if not ctx["smoke"] else CPU_DP4)
    ranks = min(gpus, 8)
    ranks -= ranks % 2 if ranks > 2 else 0  # 2 emulated nodes of ranks // 2 each
    flags = ["--distributed-backend", "nccl", *OVERLAP_FLAGS,
             "--bucket-size", str(GPU_OVERLAP["bucket_size"])]
    return ranks, flags + (["--sdp4bit-ranks-per-node", str(ranks // 2)] if ranks >= 4 else [])


def overlap_verdict(result: dict, gpu_shared: bool) -> tuple:
    """(status, detail) of a profile with a share. One process per GPU: the target. Ranks
    sharing one GPU take turns on it (the driver time-slices processes), so rank 0's
    compute stream runs only part of the time (28% with 4 ranks on the first H200 run)
    and no schedule puts a quantization kernel beside it more often than that; there a
    kernel must run beside the passes at least as often as one landing at random (the
    compute stream's busy share), which a side stream held behind the passes, or one
    they wait for, does not."""
    share, busy = result["share"], result.get("compute_busy")
    detail = (f"{share:.1%} of the quantization {result['mode']} time ran beside other work "
              f"({result['overlapped_s']:.4f} of {result['quantized_s']:.4f} s, "
              f"{OVERLAP_PROFILE['steps']} steps)")
    if busy is not None:
        detail += (f"; compute stream busy {busy:.1%} of its span, "
                   f"{result['on_compute_stream_s']:.4f} s of quantization on it")
    if not gpu_shared:
        return ("PASS" if share >= OVERLAP_TARGET else "FAIL"), f"{detail}; target >= {OVERLAP_TARGET:.0%}"
    return ("PASS" if busy is not None and share >= busy else "FAIL"), (
        f"{detail}; 4 ranks take turns on one GPU: target >= the busy share (chance), "
        f"the {OVERLAP_TARGET:.0%} target needs one process per GPU")


def step_overlap(report: Report, ctx: dict) -> None:
    """3 overlapped SDP4Bit steps profiled: the quantization kernels' share beside others'."""
    shape = dict(CPU_DP4 if ctx["smoke"] else GPU_OVERLAP)
    shape["iters"] = OVERLAP_PROFILE["after"] + OVERLAP_PROFILE["steps"] + 1
    corpus = driver_corpus(report, ctx, "overlap")
    if corpus is None:
        return
    ranks, flags = overlap_ranks(ctx)
    out_json = os.path.join(ctx["work"], "overlap_profile.json")  # its figures go to gpu_check.json
    driver = train_command("sdp4bit", shape, corpus, ctx["work"], dp=ranks, run_name="overlap")
    cmd = torchrun(ranks) + ["-m", "megatron_sdp4bit.diagnostics.overlap_profile",
                             "--profile-after", str(OVERLAP_PROFILE["after"]),
                             "--profile-steps", str(OVERLAP_PROFILE["steps"]), "--json", out_json,
                             "--"] + driver[driver.index("megatron_sdp4bit.pretrain") + 1:] + flags
    start = time.perf_counter()
    rc, _, cut = run_limited(ctx, cmd, 120, env=python_env())
    seconds = time.perf_counter() - start
    result = {}
    if os.path.isfile(out_json):
        with open(out_json, encoding="utf-8") as f:
            result = json.load(f)
    share = result.get("share")
    if rc != 0 or share is None:
        if rc is None:
            status, why = killed(cut)
        elif rc != 0 or not result:
            status, why = "FAIL", f"exit {rc}, no profile written"
        else:  # it ran and profiled, and saw no quantization kernel off the compute stream
            status, why = "FAIL", f"no quantization work seen off the {result.get('mode')} path"
        report.add("overlap", status, why, seconds, **result)
        return
    status, detail = overlap_verdict(result, gpu_shared=ranks > ctx["env"].get("gpus", 0))
    if ctx["smoke"]:
        report.add("overlap", "SKIP", detail + "; CPU self-test: 4 ranks share 2 cores",
                   seconds, **result)
    else:
        report.add("overlap", status, detail, seconds, **result)


# --- (g) Megatron-LM --------------------------------------------------------------------

def megatron_lm_version(path: str) -> Optional[str]:
    """The megatron-core version a Megatron-LM checkout carries (package_info.py), or None."""
    info = os.path.join(path, "megatron", "core", "package_info.py")
    if not os.path.isfile(info):
        return None
    values = {}
    with open(info, encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition("=")
            if key.strip() in ("MAJOR", "MINOR", "PATCH"):
                values[key.strip()] = value.strip().strip("'\"")
    return ".".join(values.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))


MEGATRON_LM_ARGS = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3",
    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "constant",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192",
    "--bf16", "--use-distributed-optimizer", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--sdp4bit",
]


MEGATRON_LM_DONE = re.compile(r"iteration\s+3/\s*3 \|")  # Megatron-LM's log line of the last step


def step_megatron_lm(report: Report, ctx: dict) -> None:
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        report.add("megatron_lm", "SKIP", "MEGATRON_LM_PATH is not set (a Megatron-LM core_v0.16.1 checkout)")
        return
    if not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        report.add("megatron_lm", "SKIP", f"MEGATRON_LM_PATH={path} has no pretrain_gpt.py")
        return
    version = megatron_lm_version(path)
    if version != "0.16.1":
        report.add("megatron_lm", "SKIP", f"MEGATRON_LM_PATH={path} is megatron-core {version}, "
                   "not core_v0.16.1")
        return
    if ctx["smoke"]:
        report.add("megatron_lm", "SKIP", "CPU self-test: Megatron-LM's pretrain_gpt.py needs CUDA")
        return
    one_rank = torchrun(1)
    env = python_env(PYTHONPATH=os.pathsep.join(filter(None, [path, ROOT, os.environ.get("PYTHONPATH")])))
    # (1) the launcher on the unedited script
    start = time.perf_counter()
    rc, output, cut = run_limited(ctx, one_rank + ["-m", "megatron_sdp4bit.launch",
                                                   os.path.join(path, "pretrain_gpt.py")]
                                  + MEGATRON_LM_ARGS, 180, env=env)
    ok = rc == 0 and MEGATRON_LM_DONE.search(output) is not None
    report.add("megatron_lm.launch", *(("PASS", "3 iterations with --sdp4bit") if ok else killed(cut)
                                       if rc is None else ("FAIL", f"exit {rc}")),
               time.perf_counter() - start)
    # (2) the patched script: a copy of pretrain_gpt.py, patched; the checkout stays untouched
    start = time.perf_counter()
    tree = os.path.join(ctx["work"], "Megatron-LM-patched")
    os.makedirs(os.path.join(tree, "megatron", "training"), exist_ok=True)  # what apply_patches checks
    shutil.copy(os.path.join(path, "pretrain_gpt.py"), tree)
    rc, output = run_logged(["bash", os.path.join(ROOT, "scripts", "apply_patches.sh"), tree],
                            timeout=time_limit(ctx, 60), env=env)
    if rc != 0:
        report.add("megatron_lm.patch", "FAIL", f"apply_patches.sh exit {rc}", time.perf_counter() - start)
        return
    rc, output, cut = run_limited(ctx, one_rank + [os.path.join(tree, "pretrain_gpt.py")]
                                  + MEGATRON_LM_ARGS, 180, env=env)
    ok = rc == 0 and MEGATRON_LM_DONE.search(output) is not None
    report.add("megatron_lm.patch", *(("PASS", "3 iterations with --sdp4bit") if ok else killed(cut)
                                      if rc is None else ("FAIL", f"exit {rc}")),
               time.perf_counter() - start)


# --- main ------------------------------------------------------------------------------

RUNNERS: Dict[str, Callable[[Report, dict], None]] = {
    "env": step_env, "triton": step_triton, "bench": step_bench, "train": step_train,
    "nccl": step_nccl, "dp4": step_dp4, "hosts": step_hosts, "overlap": step_overlap, "megatron_lm": step_megatron_lm,
}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON and the small result files")
    parser.add_argument("--work", default=None, help="folder for everything else (default: a temp folder)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run every step on CPU, tiny sizes")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"subset of {','.join(STEPS)}")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 330)),
                        help="time for the whole check (default 330 s, or $GPU_CHECK_BUDGET_S): "
                        "steps are cut short or skipped (SKIP, 'not run (budget)') so the "
                        "summary is written within it")
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    os.makedirs(args.out, exist_ok=True)
    work = args.work or tempfile.mkdtemp(prefix="gpu-check-")
    os.makedirs(work, exist_ok=True)
    ctx = dict(out=args.out, work=work, smoke=args.cpu_smoke, steps=steps, env={},
               deadline=time.time() + args.budget_s)
    report = Report()
    started = time.time()
    print(f"gpu_check: {'CPU self-test (--cpu-smoke)' if args.cpu_smoke else 'GPU check'}; "
          f"steps {','.join(steps)}; out {args.out}; work {work}", flush=True)
    if "env" not in steps:  # the other steps read it; collect without reporting
        ctx["env"] = collect_environment()
    for name in STEPS:
        if name not in steps or name == "large" and "triton" in steps:
            continue  # triton runs large in the same process
        print(f"\n--- {name if name != 'triton' else 'triton' + (' + large' if 'large' in steps else '')}",
              flush=True)
        if name != "env" and ctx["deadline"] - time.time() < 30:
            report.add(name, "SKIP", f"not run (budget): the {args.budget_s:.0f} s budget is spent")
            continue
        try:
            RUNNERS["triton" if name == "large" else name](report, ctx)
        except Exception as exc:  # noqa: BLE001 - one broken step must not hide the others
            report.add(name, "FAIL", f"the check itself crashed: {type(exc).__name__}: {exc}")
    print(report.summary(), flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w", encoding="utf-8") as f:
        json.dump({"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "started": started,
                   "seconds": round(time.time() - started, 1), "environment": ctx["env"],
                   "steps": report.results, "failed": report.failed(),
                   "result": "FAIL" if report.failed() else "PASS"}, f, indent=2, default=str)
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
