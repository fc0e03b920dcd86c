#!/usr/bin/env python3
"""Soak: a long SDP4Bit run on 4 CPU ranks (2 emulated nodes x 2), not part of ``make test``.

Three torchrun jobs of the driver, same model, data and learning-rate schedule:

1. SDP4Bit (qWD + TLq-HS) for the first half of ``--iters`` steps, checkpoint at the end;
2. the same run resumed from that checkpoint (``--load``) to ``--iters``;
3. the exact collectives (``--sdp4bit-preset baseline``) for ``--iters`` steps in one go.

The data-parallel replica check runs every ``--check-interval`` steps in every job
(a replica that differs by one bit stops the job with exit 4). The report says how
many checks passed, whether the resumed job continued from the checkpoint's
iteration, and how the SDP4Bit loss curve compares with the exact one: the mean
relative difference of the logged training loss over the last quarter and the
final validation losses. It exits non-zero when a job failed or the curves differ
by more than ``--max-loss-gap``.

    python scripts/soak.py                       # 2000 steps, about 25 min on 2 cores
    python scripts/soak.py --iters 200 --out runs/soak-short

Run ``make setup`` first.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys

from megatron_sdp4bit.jobs import checkout_commit, run_driver
from megatron_sdp4bit.recipes import SOAK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 parameters (no --bf16): on CPUs without native bf16 matrix units (this AMD
# EPYC: 8 bf16 GFLOP/s against 75 fp32) a bf16 step is 20x slower; fp32 params take
# qWD's own path (the exact main weights set aside while the optimizer steps).
# Add --bf16 through --extra to soak the bf16 path where bf16 is fast.
MODEL_FLAGS = SOAK.flags()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000, help="training steps in all (even, >= 20)")
    p.add_argument("--check-interval", type=int, default=10,
                   help="replica check every this many steps (the driver's --sdp4bit-check-interval)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--max-loss-gap", type=float, default=0.02,
                   help="largest allowed mean relative gap of the SDP4Bit training loss to the "
                        "exact run's over the last quarter (0.02 = 2%%)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "soak"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further driver flags for every job (e.g. --extra --bf16)")
    args = p.parse_args(argv)
    if args.iters < 20 or args.iters % 2:
        p.error(f"--iters {args.iters}: use an even number >= 20 (the checkpoint is at the half)")
    if args.check_interval < 1:
        p.error("--check-interval must be >= 1 (the soak is about the replica check)")
    return args


def _losses(run_dir: str, kind: str) -> dict:
    from megatron_sdp4bit.training.metrics import loss_curves

    return dict(loss_curves(os.path.join(run_dir, "metrics.jsonl"))[kind])


def _checks_passed(output: str) -> int:
    found = re.search(r"replica checks\s+(\d+) passed", output)
    return int(found.group(1)) if found else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    half = args.iters // 2
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)  # a soak is one uninterrupted story: start it afresh
    os.makedirs(args.out)
    common = MODEL_FLAGS + args.extra + [
        # 20 warm-up steps, fewer in a short soak (the driver wants them below the decay)
        "--lr-warmup-iters", min(20, args.iters // 10), "--lr-decay-iters", args.iters, "--log-interval", args.log_interval,
        "--eval-interval", args.eval_interval, "--eval-iters", "4",
        "--sdp4bit-ranks-per-node", "2", "--sdp4bit-check-interval", args.check_interval,
    ]
    ckpt = os.path.join(args.out, "checkpoints")
    jobs = {
        "sdp4bit, first half": common + ["--sdp4bit", "--train-iters", half, "--save", ckpt,
                                         "--run-dir", os.path.join(args.out, "sdp4bit-1")],
        "sdp4bit, resumed": common + ["--sdp4bit", "--train-iters", args.iters, "--load", ckpt,
                                      "--save", ckpt, "--run-dir", os.path.join(args.out, "sdp4bit-2")],
        "exact": common + ["--sdp4bit-preset", "baseline", "--train-iters", args.iters,
                           "--run-dir", os.path.join(args.out, "exact")],
    }
    report = {"iters": args.iters, "check_interval": args.check_interval,
              "commit": checkout_commit(ROOT, short=True, mark_dirty=True), "jobs": {}}
    failed = []
    for name, flags in jobs.items():
        log = os.path.join(args.out, re.sub(r"\W+", "-", name).strip("-") + ".log")
        print(f"[soak] {name}: {len(flags)} flags, log {log}", flush=True)
        job = run_driver(flags, log, cwd=ROOT)
        output = job.output()
        report["jobs"][name] = {"returncode": job.returncode, "seconds": round(job.seconds, 1),
                                "replica_checks_passed": _checks_passed(output), "log": log}
        print(f"[soak] {name}: exit {job.returncode} after {job.seconds:.0f} s, "
              f"{_checks_passed(output)} replica checks passed", flush=True)
        if job.returncode != 0:
            failed.append(f"{name} exited {job.returncode}:\n{job.tail()}")
            break
        if name == "sdp4bit, resumed" and f"at iteration {half}" not in output:
            failed.append(f"{name} did not resume at iteration {half}:\n{job.tail()}")

    if not failed:
        quant = {**_losses(os.path.join(args.out, "sdp4bit-1"), "train"),
                 **_losses(os.path.join(args.out, "sdp4bit-2"), "train")}
        exact = _losses(os.path.join(args.out, "exact"), "train")
        last_quarter = [i for i in sorted(exact) if i > args.iters * 3 // 4 and i in quant]
        gaps = [(quant[i] - exact[i]) / exact[i] for i in last_quarter]
        valid_q = _losses(os.path.join(args.out, "sdp4bit-2"), "valid")
        valid_e = _losses(os.path.join(args.out, "exact"), "valid")
        expected_checks = args.iters // args.check_interval
        checks = sum(j["replica_checks_passed"] for n, j in report["jobs"].items() if n != "exact")
        exact_checks = report["jobs"]["exact"]["replica_checks_passed"]
        report.update({
            "replica_checks_passed_sdp4bit": checks, "replica_checks_passed_exact": exact_checks,
            "replica_checks_expected_per_run": expected_checks,
            "train_loss_gap_last_quarter_mean": statistics.fmean(gaps),
            "train_loss_gap_last_quarter_max_abs": max(abs(g) for g in gaps),
            "loss_before_resume": quant.get(half), "loss_after_resume": quant.get(half + args.log_interval),
            "final_train_loss": {"sdp4bit": quant[args.iters], "exact": exact[args.iters]},
            "final_valid_loss": {"sdp4bit": valid_q.get(args.iters), "exact": valid_e.get(args.iters)},
        })
        for run, passed in (("SDP4Bit jobs", checks), ("exact job", exact_checks)):
            if passed != expected_checks:
                failed.append(f"{passed} replica checks passed in the {run}, expected {expected_checks}")
        if abs(report["train_loss_gap_last_quarter_mean"]) > args.max_loss_gap:
            failed.append(f"the SDP4Bit training loss is {report['train_loss_gap_last_quarter_mean']:+.2%} "
                          f"from the exact run's over the last quarter (limit {args.max_loss_gap:.0%})")
    report["passed"] = not failed
    report["problems"] = failed
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "jobs"}, indent=1))
    print(f"[soak] {'PASS' if not failed else 'FAIL'}: report in {os.path.join(args.out, 'soak.json')}")
    for problem in failed:
        print(f"[soak] {problem}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
