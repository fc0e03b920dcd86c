"""One adapter per supported megatron-core minor release, chosen by version.

``adapter_for(version)`` returns the adapter of that release's ``major.minor``;
``current_adapter()`` the one for the installed megatron-core. A release with no
adapter is refused unless forced (``SDP4BIT_FORCE_MEGATRON_VERSION=1``), in which
case the newest adapter is tried.
"""
from __future__ import annotations

import importlib
import os

FORCE_ENV = "SDP4BIT_FORCE_MEGATRON_VERSION"

ADAPTER_MODULES = {
    "0.16": "megatron_sdp4bit.megatron.adapters.v0_16",
    "0.17": "megatron_sdp4bit.megatron.adapters.v0_17",
    "0.18": "megatron_sdp4bit.megatron.adapters.v0_18",
    "0.19": "megatron_sdp4bit.megatron.adapters.v0_19",
}
"""Supported minor releases, oldest first. Adding one: a module here + its tests."""


def minor_of(version: str) -> str:
    """``"0.19.2"`` -> ``"0.19"``; ``"0.17.0rc0"`` -> ``"0.17"``."""
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return version
    digits = "".join(ch for ch in parts[1] if ch.isdigit()) or parts[1]
    return f"{parts[0]}.{digits}"


def megatron_version() -> str:
    try:
        import megatron.core as mcore
    except ImportError as exc:  # pragma: no cover - exercised only without megatron
        raise ImportError(
            f"megatron-core is not installed: `pip install megatron-core` (releases "
            f"{', '.join(supported_minors())}; `make test` / `make train` install it)") from exc
    return getattr(mcore, "__version__", "unknown")


def supported_minors() -> tuple:
    return tuple(ADAPTER_MODULES)


def adapter_for(version: str, force: bool = False):
    """The adapter instance for ``version``; raises on an unsupported one unless forced."""
    minor = minor_of(version)
    if minor not in ADAPTER_MODULES:
        if not (force or os.environ.get(FORCE_ENV) == "1"):
            raise RuntimeError(
                f"megatron_sdp4bit supports megatron-core {', '.join(ADAPTER_MODULES)} "
                f"(tested: {', '.join(tested_versions())}), but {version} is installed. "
                f"Install a supported version, or set {FORCE_ENV}=1 (or install(config, "
                "force_version=True)) to try the newest adapter anyway.")
        minor = list(ADAPTER_MODULES)[-1]
    return importlib.import_module(ADAPTER_MODULES[minor]).Adapter()


def current_adapter(force: bool = False):
    """The adapter for the installed megatron-core."""
    return adapter_for(megatron_version(), force=force)


def tested_versions() -> tuple:
    return tuple(v for minor in ADAPTER_MODULES
                 for v in importlib.import_module(ADAPTER_MODULES[minor]).Adapter.tested_versions)
