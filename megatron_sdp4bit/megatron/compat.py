"""Version checks: which megatron-core is installed and whether an adapter fits it.

The version-specific knowledge itself lives in ``adapters/`` (one module per
supported minor release); this module only answers "which one, and may we".
"""
from __future__ import annotations

from megatron_sdp4bit.megatron.adapters import (FORCE_ENV, adapter_for, current_adapter,
                                                megatron_version, minor_of, supported_minors,
                                                tested_versions)

__all__ = ["FORCE_ENV", "adapter_for", "current_adapter", "megatron_version", "minor_of",
           "supported_minors", "tested_versions", "check_version"]


def check_version(force: bool = False) -> str:
    """Return the installed version; raise when no adapter supports it, unless forced."""
    version = megatron_version()
    adapter_for(version, force=force)
    return version
