"""Megatron-LM's compiled dataset helpers, for the Python that runs the job.

Megatron-LM imports ``megatron.core.datasets.helpers_cpp``, a pybind11 extension of
``helpers.cpp``; at initialization rank 0 runs ``make`` in that folder, whose Makefile
asks whatever ``python3`` is first on PATH for pybind11's headers and the extension's
suffix. In a fresh checkout (which shadows the installed megatron-core) that fails
without pybind11 in that ``python3`` (``fatal error: pybind11/pybind11.h``, then every
other rank dies at the barrier that follows), or builds a module for another Python
(a pyenv honouring the checkout's ``.python-version``: ``ModuleNotFoundError:
megatron.core.datasets.helpers_cpp``).

``plan_dataset_helpers`` decides, before anything starts, on every rank alike:

1. ``built``: the helpers already import here (a build for this Python, or megatron-core's
   own wheel run without a checkout): ``make`` is skipped.
2. ``prebuilt``: the installed megatron-core ships them built for this Python from a
   ``helpers.cpp`` byte-identical to the checkout's: that module is used under the
   checkout's name, nothing is compiled.
3. ``compile``: pybind11, ``make`` and a C++ compiler are here: rank 0 runs Megatron-LM's
   own Makefile with this Python's pybind11 headers and extension suffix.

Otherwise ``HelpersUnavailable`` says, in one line, what to install. ``use_dataset_helpers``
applies the plan (``compile_helpers`` replaced, through the adapter's ``RouteSites``).
"""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from typing import Optional

from megatron_sdp4bit.patching import Patches

logger = logging.getLogger(__name__)

SOURCE = "helpers.cpp"


class HelpersUnavailable(RuntimeError):
    """The dataset helpers can neither be found nor built here; the message says what to install."""


@dataclass(frozen=True)
class HelpersPlan:
    module: str
    """The extension's module name (``megatron.core.datasets.helpers_cpp``)."""
    folder: str
    """The dataset folder of the ``megatron`` this job imports (a checkout's, or the wheel's)."""
    how: str
    """``built``, ``prebuilt`` or ``compile`` (see the module docstring)."""
    prebuilt: Optional[str] = None
    """The installed megatron-core's extension file, for ``prebuilt``."""


def _extension_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX")


def _installed_extension(folder: str, name: str) -> Optional[str]:
    """The installed megatron-core's extension ``name`` for this Python, built from the
    same ``helpers.cpp`` as ``folder``'s; None if there is none or the sources differ."""
    try:
        distribution = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    installed = os.path.dirname(str(distribution.locate_file(os.path.join("megatron", "core", "datasets",
                                                                           SOURCE))))
    if os.path.realpath(installed) == os.path.realpath(folder):
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = os.path.join(installed, name + suffix)
        if os.path.isfile(candidate):
            break
    else:
        return None
    try:
        with open(os.path.join(installed, SOURCE), "rb") as theirs, open(os.path.join(folder, SOURCE), "rb") as ours:
            return candidate if theirs.read() == ours.read() else None
    except OSError:
        return None


def _missing_build_tools() -> list:
    missing = []
    if importlib.util.find_spec("pybind11") is None:
        missing.append(f"pybind11 ({sys.executable} -m pip install pybind11)")
    if shutil.which("make") is None:
        missing.append("make (apt-get install make)")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        missing.append(f"a C++ compiler ({os.environ.get('CXX', 'g++')}: apt-get install g++, or set CXX)")
    return missing


def plan_dataset_helpers(module: str) -> HelpersPlan:
    """How this job gets ``module`` (see the module docstring); raises ``HelpersUnavailable``."""
    package, _, name = module.rpartition(".")
    spec = importlib.util.find_spec(package)  # imports megatron.core: the one the job runs
    folder = os.path.dirname(spec.origin)
    if importlib.util.find_spec(module) is not None:
        return HelpersPlan(module, folder, "built")
    prebuilt = _installed_extension(folder, name)
    if prebuilt is not None:
        return HelpersPlan(module, folder, "prebuilt", prebuilt)
    missing = _missing_build_tools()
    if missing:
        raise HelpersUnavailable(
            f"Megatron-LM builds its dataset helpers ({os.path.join(folder, SOURCE)}) for this Python at "
            f"start-up and needs {', '.join(missing)}; the installed megatron-core has no build of the "
            "same helpers.cpp for this Python to use instead")
    return HelpersPlan(module, folder, "compile")


def _load_prebuilt(plan: HelpersPlan, patches: Patches) -> None:
    """The installed extension, imported under the checkout's module name (its init
    function is named after the last part, which is the same)."""
    spec = importlib.util.spec_from_file_location(plan.module, plan.prebuilt)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    patches.set_item(sys.modules, plan.module, module)


def _build(plan: HelpersPlan) -> None:
    """Megatron-LM's Makefile, with this Python's pybind11 headers and extension suffix in
    place of what its ``python3 -m pybind11`` and ``python3-config`` would say."""
    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                              capture_output=True, text=True).stdout.strip()
    command = ["make", "-C", plan.folder, f"CPPFLAGS={includes}", f"LIBEXT={_extension_suffix()}"]
    if subprocess.run(command).returncode != 0:
        logger.error("Failed to compile the C++ dataset helper functions (%s)", " ".join(command))
        sys.exit(1)
    importlib.invalidate_caches()


def use_dataset_helpers(plan: HelpersPlan, compile_site, patches: Patches) -> None:
    """Apply ``plan`` until ``patches`` is restored: Megatron-LM's ``compile_helpers``
    (``compile_site``: its owner and name) skips ``make`` when the helpers import, and
    otherwise builds them for this Python."""
    if plan.how == "prebuilt":
        _load_prebuilt(plan, patches)
    owner, name = compile_site

    def compile_helpers():
        if importlib.util.find_spec(plan.module) is None:
            _build(plan)

    compile_helpers.__doc__ = f"SDP4Bit's launcher: {plan.module} for {sys.executable} ({plan.how})."
    patches.set(owner, name, compile_helpers)
