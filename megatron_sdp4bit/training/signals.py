"""The exit-signal handler: a signal (a preemption, Ctrl-C) or the launcher's death makes
the run save at a step boundary and stop.

As in Megatron-LM, a signal only sets a flag while training. The signal may
reach the ranks at different steps (or some not at all), so after every
iteration the ranks agree whether any has it, with a MAX all-reduce on a CPU
(gloo) group: no device synchronisation, the same decision at the same step
boundary on every rank. Then the run saves (``--save``) and stops with
``StoppedBySignal``; the exit code is 128 + the signal's number (130 for SIGINT,
143 for SIGTERM), as for a process the signal ended, so a scheduler sees an
interrupted job, not a finished one.

Which signals: ``--exit-signal`` and every signal a launcher sends to stop its
ranks (``STOP_SIGNALS``). torchrun forwards the signal it got and, when a second
one reaches it during its shutdown (a second Ctrl-C, a wrapper that forwards
Ctrl-C too), sends SIGTERM right after: a handler of one signal only lost the run
to the other. SIGQUIT (Ctrl-\\) keeps its default, an immediate quit. A signal
the process was started ignoring (``nohup``'s SIGHUP) stays ignored, except
under a launcher, which sends it only to stop the rank (torchrun installs its own
SIGHUP handler even under ``nohup``, and kills the ranks after its grace period).

The launcher's death (``launcher_watch.py``: its death signal, or another parent at a
step boundary) counts as a signal: the ranks agree on it alike, save and stop,
with exit code 143 (as for the SIGTERM torchrun would have sent).

During set-up (``StopBeforeTraining``) the same signals stop the run at once:
nothing is trained yet, so there is nothing to save.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sdp4bit.comm.backends import backend_of
from megatron_sdp4bit.launcher_watch import DEATH_SIGNAL, Launcher

SIGNALS = {name: getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")}
"""``--exit-signal``'s choices."""
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
"""Handled whatever ``--exit-signal`` is: what launchers and terminals send to stop a job."""


class StoppedBySignal(RuntimeError):
    """The run stopped at a step boundary because a rank received a stop signal (or
    its launcher died)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StoppedDuringSetUp(BaseException):
    """A stop signal (or the launcher's death) came during set-up: the run stops at
    once, nothing saved. A ``BaseException``, as ``KeyboardInterrupt`` is: it is
    raised wherever set-up happens to be, and an ``except Exception`` there (one that
    turns an unreadable file into a clear error) must not take it for its own."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interrupted_without_handler(save: Optional[str]) -> str:
    """What a Ctrl-C did with the handler off (no ``--save``, or ``--no-exit-signal-handler``):
    Python's ``KeyboardInterrupt`` ended the run where it was (before: its traceback)."""
    if not save:
        return "SIGINT received: stopped at once, nothing saved (no --save)"
    return (f"SIGINT received: stopped at once (--no-exit-signal-handler), nothing saved since the latest "
            f"checkpoint in {save}; resume with --load {save}")


@dataclass(frozen=True)
class StopRequest:
    """What the ranks agreed on: the signal (the largest number of the first signal
    each rank got; 0 for none), and whether a rank's launcher exited."""

    signum: int
    launcher_exited: bool

    def describe(self, launcher: Optional[Launcher]) -> str:
        """What stopped the run: the launcher's death, when a rank saw it, rather than
        a signal that came with it (one torchrun forwarded before it was killed)."""
        if self.launcher_exited:
            return f"{launcher.describe() if launcher else 'its launcher'} exited"
        return f"{signal.Signals(self.signum).name} received"

    @property
    def exit_code_signum(self) -> int:
        return self.signum or signal.SIGTERM  # the launcher's death alone: as torchrun's SIGTERM


class _StopHandlers:
    """Handlers of the stop signals and of the launcher's death signal while inside
    (a context manager); outside, the handlers that were there before are back."""

    def __init__(self, exit_signal: str = "SIGTERM", launcher: Optional[Launcher] = None):
        self.signums = [getattr(signal, name) for name in dict.fromkeys((exit_signal, *STOP_SIGNALS))]
        self.launcher = launcher
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        raise NotImplementedError

    def _handle_death(self, signum, frame) -> None:
        raise NotImplementedError

    def __enter__(self):
        for signum in self.signums:
            if signal.getsignal(signum) == signal.SIG_IGN and self.launcher is None:
                continue  # nohup
            self._previous[signum] = signal.signal(signum, self._handle)
        if self.launcher is not None and DEATH_SIGNAL is not None:
            self._previous[DEATH_SIGNAL] = signal.signal(DEATH_SIGNAL, self._handle_death)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


class StopBeforeTraining(_StopHandlers):
    """Set-up (before the first iteration): a stop signal, or the launcher's death,
    raises ``StoppedDuringSetUp`` at once. Nothing is trained yet, so nothing is saved,
    and a set-up can take minutes (a corpus to tokenize, a checkpoint to verify):
    one line and the exit code, instead of a ``KeyboardInterrupt`` traceback on every
    rank or an end without a word."""

    def _handle(self, signum, frame) -> None:
        raise StoppedDuringSetUp(f"{signal.Signals(signum).name} received during set-up: stopped before "
                                 "training, nothing saved", signum)

    def _handle_death(self, signum, frame) -> None:
        raise StoppedDuringSetUp(f"{self.launcher.describe()} exited during set-up: stopped before "
                                 "training, nothing saved", signal.SIGTERM)


class StopOnSignals(_StopHandlers):
    """Training: the stop signals set ``first`` (the first one received), the
    launcher's death signal ``launcher_died``, for the ranks to agree on at the next
    step boundary. Made on every rank alike (it may create a process group)."""

    def __init__(self, exit_signal: str = "SIGTERM", launcher: Optional[Launcher] = None):
        super().__init__(exit_signal, launcher)
        self.first: Optional[int] = None
        self.launcher_died = False
        # The check is a host-side collective: on NCCL it gets a gloo group of its own.
        self._group: Optional[object] = (None if backend_of(None, "cpu") == "gloo"
                                         else torch.distributed.new_group(backend="gloo"))

    def _handle(self, signum, frame) -> None:
        if self.first is None:
            self.first = signum

    def _handle_death(self, signum, frame) -> None:
        self.launcher_died = True

    def agreed(self) -> Optional[StopRequest]:
        """Collective: what any rank has received so far (or its launcher's death);
        None when nothing."""
        exited = self.launcher_died or (self.launcher is not None and self.launcher.exited())
        flags = torch.tensor([self.first or 0, int(exited)], dtype=torch.int32)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self._group)
        signum, exited = (int(x) for x in flags.tolist())
        return StopRequest(signum, bool(exited)) if signum or exited else None
