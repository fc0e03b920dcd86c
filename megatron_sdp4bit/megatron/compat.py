"""Everything that depends on the megatron-core version, in one place.

The patch layer replaces methods whose bodies it mirrors (see patch.py), so it is
tied to the versions it was written and tested against. An untested version is
refused with a clear message unless the user forces it.
"""
from __future__ import annotations

import os

TESTED_VERSIONS = ("0.16.1",)
FORCE_ENV = "SDP4BIT_FORCE_MEGATRON_VERSION"


def megatron_version() -> str:
    try:
        import megatron.core as mcore
    except ImportError as exc:  # pragma: no cover - exercised only without megatron
        raise ImportError(
            "megatron-core is not installed: `pip install megatron-core==0.16.1` "
            "(or run `make test` / `make train`, which install it)"
        ) from exc
    return getattr(mcore, "__version__", "unknown")


def check_version(force: bool = False) -> str:
    """Return the installed version; raise on an untested one unless forced."""
    version = megatron_version()
    if version in TESTED_VERSIONS or force or os.environ.get(FORCE_ENV) == "1":
        return version
    raise RuntimeError(
        f"megatron_sdp4bit was tested with megatron-core {', '.join(TESTED_VERSIONS)}, "
        f"but {version} is installed. Install a tested version, or set {FORCE_ENV}=1 "
        "(or install(config, force_version=True)) to try anyway."
    )


def patch_targets():
    """The classes whose methods the patch layer replaces (megatron-core 0.16.x)."""
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return _ParamAndGradBucketGroup, DistributedOptimizer, DistributedDataParallel
