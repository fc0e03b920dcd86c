"""``make train``: a small GPT on 4 CPU ranks that emulate 2 nodes x 2 ranks, with SDP4Bit.

Prepares the embedded corpus once (cached), then runs the pre-training driver
under torchrun with the paper's method (``--sdp4bit``: qWD 4-bit weights,
TLq-HS 8/4-bit gradients across the emulated nodes). Extra flags after the
defaults override them: ``make train ARGS="--train-iters 50 --sdp4bit-preset zeropp"``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import List, Optional

from megatron_sdp4bit import recipes
from megatron_sdp4bit.jobs import driver_command, job_env

RANKS = recipes.MAKE_TRAIN_RANKS
RANKS_PER_NODE = recipes.MAKE_TRAIN_RANKS_PER_NODE
RECIPE_FLAGS = recipes.MAKE_TRAIN.flags()
"""The model, data and schedule of ``make train`` (``recipes.MAKE_TRAIN``: fp32
parameters, and why)."""

DEFAULT_FLAGS = RECIPE_FLAGS + ["--sdp4bit", "--sdp4bit-ranks-per-node", str(RANKS_PER_NODE)]

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference",
                         "make_train_exact.json")
"""The exact-collective run of this recipe (seed 1234), written by
``scripts/make_train_reference.py``: ``make train`` draws its curve over it
without running it again."""


def overlay_on_reference(run_dir: str, extra: list) -> Optional[str]:
    """Plot this run over the shipped exact-collective run; None (and why) when the
    flags changed the recipe or nothing can be drawn."""
    changed = [flag for flag in extra if flag.startswith("--") and not flag.startswith("--sdp4bit")]
    if changed:
        print(f"no exact-collective reference for this recipe (changed: {' '.join(changed)}); "
              "loss.png shows this run alone", flush=True)
        return None
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not (os.path.isfile(REFERENCE) and os.path.isfile(metrics)):
        return None
    with open(REFERENCE, encoding="utf-8") as f:
        reference = json.load(f)
    if reference.get("recipe_flags") != RECIPE_FLAGS:
        print(f"{REFERENCE} was made for another recipe: rerun scripts/make_train_reference.py",
              flush=True)
        return None
    from megatron_sdp4bit.training.metrics import plot_losses, read_metrics

    valid = [r["loss"] for r in read_metrics(metrics) if r["kind"] == "valid"]
    exact = reference["valid"][-1][1]
    if valid:
        print(f"final validation loss {valid[-1]:.4f} vs {exact:.4f} with the exact collectives "
              f"({100 * (valid[-1] / exact - 1):+.2f}%; reference {os.path.relpath(REFERENCE)})",
              flush=True)
    return plot_losses(metrics, os.path.join(run_dir, "loss_vs_exact.png"),
                       title="make train: this run over the exact-collective run",
                       reference=reference, label="this run", reference_label="exact collectives")


def command_flags(extra: List[str]) -> List[str]:
    """The driver's flags for ``make train ARGS="extra"``: the recipe (its warm-up
    following ARGS' --train-iters, ``Recipe.under``), SDP4Bit, then ``extra``. With no
    ARGS these are ``DEFAULT_FLAGS``, which the shipped reference was made with."""
    flags = recipes.MAKE_TRAIN.under(extra).flags()
    return flags + DEFAULT_FLAGS[len(RECIPE_FLAGS):] + list(extra)


def refusal(flags: List[str], extra: List[str]) -> Optional[str]:
    """The driver's one-line refusal of ``flags`` on make train's ranks, checked here
    (no torchrun); a flag of the recipe it names that ARGS did not set is said to be
    the recipe's. None when the flags are accepted."""
    from megatron_sdp4bit.training.arguments import ArgumentError, parse_args
    from megatron_sdp4bit.training.distributed import parallel_layout

    try:
        parallel_layout(parse_args(flags), RANKS)
        return None
    except ArgumentError as error:
        message = str(error)
    named = [f"{flag} {value}".strip() for flag, value in recipes.hidden_flags(flags, extra).items()
             if re.search(re.escape(flag) + r"(?![\w-])", message)]
    if named:
        message += (f" ({', '.join(named)}: make train's recipe, megatron_sdp4bit/recipes.py; set "
                    f"{'it' if len(named) == 1 else 'them'} in ARGS to change {'it' if len(named) == 1 else 'them'})")
    return f"make train: error: {message}"


def run_job(cmd: List[str]) -> int:
    """Run the job, its stderr passed through as it comes; when it fails, the driver's
    own line (``sdp4bit-pretrain: error: ...``) is printed again, last, under
    torchrun's report. A Ctrl-C reaches the job too (one process group), which stops
    on its own: this keeps passing its output on until it has."""
    process = subprocess.Popen(cmd, env=job_env(), stderr=subprocess.PIPE)
    tail = b""
    while True:
        try:
            chunk = os.read(process.stderr.fileno(), 1 << 16)
        except KeyboardInterrupt:
            continue
        if not chunk:
            break
        sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.flush()
        tail = (tail + chunk)[-(1 << 20):]
    while True:
        try:
            code = process.wait()
            break
        except KeyboardInterrupt:
            continue
    lines = [line for line in tail.decode("utf-8", "replace").splitlines()
             if line.startswith("sdp4bit-pretrain: ")]
    if code and lines:
        print(f"make train: the job failed (exit {code}): {lines[-1]}", file=sys.stderr, flush=True)
    return code


def prepare_corpus(extra: List[str]) -> None:
    """Build the embedded corpus the run will read (once, cached), before the ranks
    start: none with ``--data-path`` in ARGS, the capped one with ``--default-corpus-mb``."""
    from megatron_sdp4bit.data import prepare_default_corpus
    from megatron_sdp4bit.data.corpus import default_corpus_meta

    given = recipes.flag_values(extra)
    if "--data-path" in given:
        return
    t0 = time.perf_counter()
    print("preparing the embedded corpus (Python's standard library; cached after the first run)...",
          flush=True)
    cap = given.get("--default-corpus-mb")
    prefix = prepare_default_corpus(max_mb=float(cap) if cap else None)
    meta = default_corpus_meta(prefix)
    print(f"corpus ready in {time.perf_counter() - t0:.1f} s: {prefix} "
          f"({meta['files']} files, {meta['bytes'] / 2**20:.1f} MiB of text, {meta['tokens']:,} tokens)",
          flush=True)


def main(argv=None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    flags = command_flags(extra)
    refused = refusal(flags, extra)
    if refused:
        print(refused, file=sys.stderr, flush=True)
        return 2
    try:
        prepare_corpus(extra)
    except ValueError as error:  # the cache folder cannot be written: one line, as the driver says it
        print(f"make train: error: {error}", file=sys.stderr, flush=True)
        return 2
    run_dir = os.path.join("runs", "make-train-" + time.strftime("%Y%m%d-%H%M%S"))
    cmd = driver_command([*flags[:len(flags) - len(extra)], "--run-dir", run_dir, *extra], RANKS)
    print(f"launching {RANKS} CPU ranks as {RANKS // RANKS_PER_NODE} emulated nodes x "
          f"{RANKS_PER_NODE}:\n  {' '.join(cmd[2:])}", flush=True)
    code = run_job(cmd)
    if code == 0:
        png = overlay_on_reference(run_dir, extra)
        if png:
            print(f"loss vs exact       {png}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
