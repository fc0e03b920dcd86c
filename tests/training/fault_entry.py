"""Test-only entry point: the pre-training driver, with one rank killing itself mid-step.

    torchrun ... tests/training/fault_entry.py KILL_RANK KILL_ITERATION STAMP_FILE <driver flags>

Rank KILL_RANK sends itself SIGKILL inside the forward pass of iteration
KILL_ITERATION (counted from the start of this run), after writing the time to
STAMP_FILE, as a crashed GPU or an OOM-killed process would end.
"""
from __future__ import annotations

import os
import signal
import sys
import time


def main() -> int:
    kill_rank, kill_iteration, stamp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    argv = sys.argv[4:]
    import megatron_sdp4bit.pretrain as driver
    from megatron_sdp4bit.training import step

    forward = step.forward_step
    calls = [0]

    def forward_then_die(data_iterator, model):
        calls[0] += 1
        if int(os.environ["RANK"]) == kill_rank and calls[0] == kill_iteration:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(data_iterator, model)

    step.forward_step = forward_then_die  # the run takes the module's at its start
    return driver.main(argv)


if __name__ == "__main__":
    sys.exit(main())
