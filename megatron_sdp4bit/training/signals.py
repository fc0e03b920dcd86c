"""``--exit-signal-handler``: a signal (a scheduler's preemption) makes the run save and stop.

As in Megatron-LM: while training, ``--exit-signal`` (SIGTERM by default) only
sets a flag. The signal may reach the ranks at different steps (or some not at
all), so after every iteration the ranks agree whether any has it, with a MAX
all-reduce of one integer on a CPU (gloo) group: no device synchronisation, the
same decision at the same step boundary on every rank. Then the run saves
(``--save``) and stops with ``StoppedBySignal``; the exit code is 128 + the signal's
number (143 for SIGTERM), as for a process the signal ended, so a scheduler sees
an interrupted job, not a finished one.
"""
from __future__ import annotations

import signal
from typing import Optional

import torch

SIGNALS = {name: getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")}


class StoppedBySignal(RuntimeError):
    """The run stopped at a step boundary because a rank received the exit signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class ExitSignal:
    """A context manager: while inside, the signal sets ``received``; outside, the
    handler that was there before is back. Made on every rank alike (it may create a
    process group)."""

    def __init__(self, name: str = "SIGTERM"):
        self.name = name
        self.signum = SIGNALS[name]
        self.received = False
        self._previous = None
        # The check is a host-side collective: on NCCL it gets a gloo group of its own.
        self._group: Optional[object] = (None if torch.distributed.get_backend() == "gloo"
                                         else torch.distributed.new_group(backend="gloo"))

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> "ExitSignal":
        self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.signum, self._previous)

    def received_anywhere(self) -> bool:
        """Collective: whether any rank has received the signal so far."""
        flag = torch.tensor([int(self.received)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
