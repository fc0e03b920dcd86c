"""A CPU backend for megatron-core: its own GPT + DDP + distributed-optimizer code path
on CPU tensors over gloo, and Megatron-LM's training loop on top (docs/cpu_backend.md).

- ``core.py``: ``enable_cpu_backend()`` / ``disable_cpu_backend()`` /
  ``cpu_backend()`` for megatron-core, every redirected site listed with its reason;
- ``megatron_training.py``: ``enable_cpu_training()`` ... for ``megatron.training``
  (``SDP4BIT_CPU=1`` for the launcher); ``megatron_args.py``: the arguments a CPU run
  needs; ``checkpoint_worker.py``: megatron's persistent checkpoint worker on CPU;
- ``cuda_twins.py``, ``rng.py``: the CPU stand-ins; ``redirects.py``: ``Redirects``, the
  on/off state each of the two is (one object per process).

Which sites a megatron-core release has is its adapter's (``cpu_backend_sites()``,
``cpu_training_sites()``, typed in ``megatron/adapters/cpu_sites.py``); every change
goes through ``megatron_sdp4bit.patching``. This package knows nothing of SDP4Bit's
layer: it only makes megatron run where there is no GPU.
"""
from megatron_sdp4bit.cpu_backend.core import (cpu_backend, disable_cpu_backend, enable_cpu_backend,
                                               is_cpu_backend_enabled)
from megatron_sdp4bit.cpu_backend.megatron_training import (ENV_VAR, cpu_training, cpu_training_requested,
                                                            disable_cpu_training, enable_cpu_training,
                                                            is_cpu_training_enabled)

__all__ = ["enable_cpu_backend", "disable_cpu_backend", "is_cpu_backend_enabled", "cpu_backend",
           "ENV_VAR", "enable_cpu_training", "disable_cpu_training", "is_cpu_training_enabled",
           "cpu_training", "cpu_training_requested"]
