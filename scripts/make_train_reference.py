#!/usr/bin/env python3
"""Write the exact-collective reference curve ``make train`` draws its run over.

Runs ``make train``'s recipe (megatron_sdp4bit.demo.RECIPE_FLAGS, seed 1234) with
the exact collectives on 4 CPU ranks as 2 emulated nodes x 2 and stores its
training and validation losses in megatron_sdp4bit/reference/make_train_exact.json
(a few KB, shipped with the package), so that ``make train`` is not slowed by a
second run. Rerun it whenever RECIPE_FLAGS change (``make train`` says so). Run
``make setup`` first.

    python scripts/make_train_reference.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from megatron_sdp4bit.demo import RANKS, RANKS_PER_NODE, RECIPE_FLAGS, REFERENCE
from megatron_sdp4bit.jobs import checkout_commit, run_driver
from megatron_sdp4bit.training.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        flags = RECIPE_FLAGS + ["--sdp4bit-preset", "baseline",
                                "--sdp4bit-ranks-per-node", str(RANKS_PER_NODE),
                                "--run-dir", os.path.join(tmp, "run")]
        job = run_driver(flags, os.path.join(tmp, "log.txt"), ranks=RANKS, cwd=ROOT)
        if job.returncode != 0:
            print(job.tail(40), file=sys.stderr)
            return job.returncode
        records = read_metrics(os.path.join(tmp, "run", "metrics.jsonl"))
    commit = checkout_commit(ROOT)
    reference = {
        "what": "make train's recipe with the exact collectives (--sdp4bit-preset baseline)",
        "recipe_flags": RECIPE_FLAGS, "ranks": RANKS, "ranks_per_node": RANKS_PER_NODE,
        "command": "python scripts/make_train_reference.py", "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "train": [[r["iteration"], r["loss"]] for r in records if r["kind"] == "train"],
        "valid": [[r["iteration"], r["loss"]] for r in records if r["kind"] == "valid"],
    }
    os.makedirs(os.path.dirname(REFERENCE), exist_ok=True)
    with open(REFERENCE, "w") as f:
        json.dump(reference, f, indent=1)
    print(f"wrote {REFERENCE}: final validation loss {reference['valid'][-1][1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
