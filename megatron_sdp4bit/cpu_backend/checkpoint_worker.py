"""10. Megatron's persistent checkpoint worker on CPU (``--async-save --use-persistent-ckpt-worker``).

megatron-core runs each asynchronous save in a worker process it starts once,
``PersistentAsyncCaller.async_loop`` in a *spawned* interpreter: none of this process's
redirects are there. The loop's first line picks the rank's GPU,
``torch.cuda.set_device(rank % torch.cuda.device_count())`` (a ZeroDivisionError
without one), and each save's copy to host memory ends in ``torch.cuda.synchronize()``;
the worker died, and the rank waited for it at its first save, for good.

While the CPU mode is on, the loop megatron starts is ``run_on_cpu`` bound to the loop's
site (``redirect_worker``): in the worker it runs megatron's own loop with
``torch.cuda`` answering as one CPU "device", as redirect 2 does here. Both are
module-level names, so the spawned process finds them by import. The worker may enable
the CPU mode too (spawning re-runs the training script's top level, which may call
``enable_cpu_training``): megatron's own loop is then kept under ``ORIGINAL``, so the
replacement never calls itself.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_sdp4bit.patching import Patches

ORIGINAL = "__sdp4bit_cpu_original_async_loop__"
"""Where the owner keeps megatron's loop while the replacement is in place."""


def _one_device() -> int:
    return 1


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def run_on_cpu(owner: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """Megatron's worker loop (``owner.name``, or what ``ORIGINAL`` keeps where the CPU mode
    is on in the worker too) with ``torch.cuda`` as one CPU device: selecting it and
    waiting for it do nothing."""
    loop = getattr(owner, ORIGINAL, None) or getattr(owner, name)
    with Patches("CPU checkpoint worker") as on_cpu:
        on_cpu.set(torch.cuda, "device_count", _one_device)
        on_cpu.set(torch.cuda, "set_device", _nothing)
        on_cpu.set(torch.cuda, "synchronize", _nothing)
        return loop(*args, **kwargs)


def redirect_worker(site, patches: Patches) -> None:
    """Replace the static method at ``site`` (owner, name) with ``run_on_cpu`` bound to it,
    picklable by reference (megatron hands it to ``multiprocessing`` as the target), and
    keep megatron's own under ``ORIGINAL``; ``patches`` puts both back."""
    owner, name = site
    patches.set(owner, ORIGINAL, vars(owner)[name], must_exist=False)
    patches.set(owner, name, staticmethod(functools.partial(run_on_cpu, owner, name)))
