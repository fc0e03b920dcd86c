"""Test-only entry point: the pre-training driver, with one rank's forward pass asking
for more memory than there is (an allocation the CPU allocator refuses at once).

    torchrun ... tests/training/allocation_entry.py RANK ITERATION <driver flags>

Rank RANK allocates a petabyte inside the forward pass of iteration ITERATION
(counted from the start of this run): torch's own allocation failure, on that
rank alone, as a pipeline stage holding more than the others meets it.
"""
from __future__ import annotations

import os
import sys


def main() -> int:
    failing_rank, failing_iteration = int(sys.argv[1]), int(sys.argv[2])
    import torch

    import megatron_sdp4bit.pretrain as driver
    from megatron_sdp4bit.training import step

    forward = step.forward_step
    calls = [0]

    def forward_out_of_memory(data_iterator, model):
        calls[0] += 1
        if int(os.environ["RANK"]) == failing_rank and calls[0] == failing_iteration:
            torch.empty(1 << 50, dtype=torch.uint8)
        return forward(data_iterator, model)

    step.forward_step = forward_out_of_memory  # the run takes the module's at its start
    return driver.main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
