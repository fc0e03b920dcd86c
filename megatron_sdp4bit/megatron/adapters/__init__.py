"""One adapter per supported megatron-core minor release, chosen by version.

``adapter_for(version)`` returns the adapter of that release's ``major.minor``;
``current_adapter()`` the one for the installed megatron-core. A release with no
adapter is refused unless forced (``SDP4BIT_FORCE_MEGATRON_VERSION=1``), in which
case the newest adapter is tried.
"""
from __future__ import annotations

import importlib
import os
import re

FORCE_ENV = "SDP4BIT_FORCE_MEGATRON_VERSION"
_PACKAGE = "megatron_sdp4bit.megatron.adapters"  # spelled out: scripts run this file by path


def _adapter_modules() -> dict:
    """``{"0.16": "megatron_sdp4bit.megatron.adapters.v0_16", ...}``: every ``vMAJOR_MINOR.py``
    next to this file, oldest first. Reads file names only (no import), so that
    ``scripts/mcore_venv.sh`` and ``setup.py`` can read the list without torch."""
    found = {}
    for name in os.listdir(os.path.dirname(os.path.abspath(__file__))):
        match = re.fullmatch(r"v(\d+)_(\d+)\.py", name)
        if match:
            found[(int(match[1]), int(match[2]))] = f"{_PACKAGE}.{name[:-3]}"
    return {f"{major}.{minor}": found[(major, minor)] for major, minor in sorted(found)}


ADAPTER_MODULES = _adapter_modules()
"""Supported minor releases, oldest first: one ``vMAJOR_MINOR.py`` module each, so adding
a release is adding its module (and its tests)."""


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
