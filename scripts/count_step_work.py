#!/usr/bin/env python
"""Count what one training step asks of the device, per preset: operations and host reads.

On a GPU every aten operation is (at least) one kernel launch, and every read of a
device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``) stalls the host until the device has caught up, so the host can no
longer queue the next kernels while the device works. Both are properties of the
code, not of the machine: counted here on the CPU, one rank, they are what the
same step would do on a GPU. The difference between presets is what the patch
layer adds (with one rank nothing is quantized, so ideally nothing).

    python scripts/count_step_work.py                        # sdp4bit vs baseline, 1 rank
    python scripts/count_step_work.py --presets sdp4bit,baseline,zeropp --iters 6

Counts are per step, over the steps after the first two (warm-up), and exclude
the steps where the driver logs. Run ``make setup`` first.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

from megatron_sdp4bit.recipes import STEP_WORK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = STEP_WORK.flags()
HOST_READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu")


def _count_one(preset: str, iters: int, log_interval: int) -> dict:
    """Run in this process: the driver on one rank, counting inside train_step."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_sdp4bit.training.arguments import parse_args
    from megatron_sdp4bit.training.distributed import shutdown
    from megatron_sdp4bit.training.run import TrainingRun
    from megatron_sdp4bit.training.setup import set_up

    ops: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()
    counting = [False]

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, _original=original, _name=name, **k):
            if counting[0]:
                reads[_name] += 1
            return _original(self, *a, **k)

        setattr(torch.Tensor, name, wrapper)

    seen = [0]

    def counted_step(*args, **kwargs):
        seen[0] += 1
        measured = seen[0] > 2 and seen[0] % log_interval != 0
        counting[0] = measured
        try:
            if measured:
                with CountOps():
                    return step(*args, **kwargs)
            return step(*args, **kwargs)
        finally:
            counting[0] = False

    args = parse_args(MODEL + ["--sdp4bit", "--sdp4bit-preset", preset, "--train-iters", str(iters),
                               "--log-interval", str(log_interval),
                               "--run-dir", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                         f"count-step-{preset}")])
    training = TrainingRun(set_up(args))
    step = training.train_step  # one iteration, without the run's bookkeeping
    training.train_step = counted_step
    training.train()
    shutdown()
    measured = sum(1 for k in range(1, iters + 1) if k > 2 and k % log_interval)
    return {"preset": preset, "steps": measured,
            "ops_per_step": sum(ops.values()) / measured,
            "host_reads_per_step": sum(reads.values()) / measured,
            "host_reads": {k: v / measured for k, v in sorted(reads.items())},
            "top_ops": {k: v / measured for k, v in ops.most_common(12)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="sdp4bit,baseline")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--log-interval", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_count_one(args.one, args.iters, args.log_interval)))
        return 0
    results = []
    for preset in args.presets.split(","):  # one process each: the patch layer installs once
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", preset,
                              "--iters", str(args.iters), "--log-interval", str(args.log_interval)],
                             capture_output=True, text=True, cwd=ROOT, check=False)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r for r in results if r["preset"] == "baseline"), results[0])
    print(f"{'preset':<10} {'ops/step':>9} {'vs baseline':>12} {'host reads/step':>16}  reads")
    for r in results:
        print(f"{r['preset']:<10} {r['ops_per_step']:>9.0f} {r['ops_per_step'] - base['ops_per_step']:>+12.0f} "
              f"{r['host_reads_per_step']:>16.1f}  {r['host_reads']}")
    print("command: python scripts/count_step_work.py " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
