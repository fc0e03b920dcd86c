"""The launcher that started this rank (torchrun), watched: a rank must not outlive it.

torchrun starts every rank in a session of its own, so a signal to the job's
process group (Ctrl-C, a scheduler's ``kill``) reaches torchrun only. torchrun
forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT (its ``--signals-to-handle``) to the
ranks and kills them after its grace period (30 s). A torchrun that dies without
forwarding -- SIGKILL, or a signal it does not handle, such as SIGUSR1, whose
default action ends it -- used to leave its ranks training on as orphans, writing
checkpoints into ``--save``. So each rank

- asks the kernel for ``DEATH_SIGNAL`` when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, Linux). The exit-signal handler takes it as a stop
  (save at the next step boundary); without the handler its default action ends
  the rank at once. A signal of its own, not SIGTERM: a launcher killed outright
  ends thread by thread, and the signal comes as the thread that started the rank
  ends, while ``os.getppid()`` may name the dying launcher for a while longer
  (seconds on a loaded machine), so only the signal says which stop it is.
  torchrun starts its ranks from its main thread, which lives as long as it does.
- checks at every step boundary whether its parent is still the launcher
  (``os.getppid()``): the same stop where there is no ``prctl``.

Only torchrun's ranks are watched (``TORCHELASTIC_RUN_ID`` in the environment): the
parent of a plain process may end by design (``python ... &`` in a script). Both
routes call ``watch_launcher`` first thing: the driver (``pretrain.main``, whose
handler stops on the signal) and the Megatron-LM launcher (``megatron_lm/launcher.py``:
Megatron-LM's handler knows one signal, so the death signal ends the rank at once).
No torch here: it is imported before anything heavy.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from dataclasses import dataclass
from typing import Mapping, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEATH_SIGNAL: Optional[int] = (signal.SIGRTMIN + 7 if sys.platform.startswith("linux")
                               and hasattr(signal, "SIGRTMIN") else None)
"""What a rank receives when its launcher dies: a real-time signal no launcher or
scheduler sends (the first few are the C library's own); its default action ends
the process."""


@dataclass(frozen=True)
class Launcher:
    """The process that started this rank."""

    pid: int
    name: str = "torchrun"

    def exited(self) -> bool:
        """Whether this rank belongs to another parent now."""
        return os.getppid() != self.pid

    def describe(self) -> str:
        return f"its launcher ({self.name}, pid {self.pid})"


def _ask_for_death_signal(signum: int) -> bool:
    """``signum`` to this process when its parent (thread) exits; False if refused."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def watch_launcher(environ: Mapping[str, str]) -> Optional[Launcher]:
    """This rank's launcher when torchrun started it, with the death signal asked for
    (Linux); None for a process no launcher started. Call it first thing in the rank:
    a launcher that died before this call is taken to be the process that adopted
    the rank, unless that is init (pid 1), which no launcher is -- then the death
    signal comes at once."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    launcher = Launcher(os.getppid())
    if DEATH_SIGNAL is not None:
        _ask_for_death_signal(DEATH_SIGNAL)
        if launcher.pid == 1 or launcher.exited():  # it died before (or while) we asked
            os.kill(os.getpid(), DEATH_SIGNAL)
    return launcher
