"""``make train``: a small GPT on 4 CPU ranks that emulate 2 nodes x 2 ranks, with SDP4Bit.

Prepares the embedded corpus once (cached), then runs the pre-training driver
under torchrun with the paper's method (``--sdp4bit``: qWD 4-bit weights,
TLq-HS 8/4-bit gradients across the emulated nodes). Extra flags after the
defaults override them: ``make train ARGS="--train-iters 50 --sdp4bit-preset zeropp"``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

RANKS = 4
RANKS_PER_NODE = 2

DEFAULT_FLAGS = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
    "--train-iters", "200", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--use-distributed-optimizer",
    "--log-interval", "10", "--eval-interval", "50", "--eval-iters", "4",
    "--split", "969,30,1",
    "--sdp4bit", "--sdp4bit-ranks-per-node", str(RANKS_PER_NODE),
]


def main(argv=None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    from megatron_sdp4bit.data import prepare_default_corpus
    from megatron_sdp4bit.data.corpus import default_corpus_meta

    t0 = time.perf_counter()
    print("preparing the embedded corpus (Python's standard library; cached after the first run)...",
          flush=True)
    prefix = prepare_default_corpus()
    meta = default_corpus_meta(prefix)
    print(f"corpus ready in {time.perf_counter() - t0:.1f} s: {prefix} "
          f"({meta['files']} files, {meta['bytes'] / 2**20:.1f} MiB of text, {meta['tokens']:,} tokens)",
          flush=True)
    run_dir = os.path.join("runs", "make-train-" + time.strftime("%Y%m%d-%H%M%S"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={RANKS}", "-m", "megatron_sdp4bit.pretrain",
           *DEFAULT_FLAGS, "--run-dir", run_dir, *extra]
    print(f"launching {RANKS} CPU ranks as {RANKS // RANKS_PER_NODE} emulated nodes x "
          f"{RANKS_PER_NODE}:\n  {' '.join(cmd[2:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
