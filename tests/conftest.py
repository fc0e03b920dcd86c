"""Shared test set-up: import path and a deterministic hypothesis profile.

- The repository root goes on sys.path, so ``pytest`` works from a checkout that
  was not ``pip install -e``-ed; so does tests/ itself, for the multi-rank
  harness that lives there and not in the installed package (``harness``).
- Hypothesis runs derandomized (the same examples every run: tests are
  deterministic), without a deadline (the CPU is shared, timings are noise) and
  without writing an example database into the tree. Select another profile
  with HYPOTHESIS_PROFILE=<name> (e.g. ``thorough``: more examples, random).
"""
from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.join(REPO_ROOT, "tests")
for path in (TESTS_DIR, REPO_ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

try:
    from hypothesis import settings
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    settings = None

if settings is not None:
    settings.register_profile("default", derandomize=True, deadline=None, database=None)
    settings.register_profile("thorough", max_examples=500, deadline=None, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Tests of code that never imports megatron-core: the quantization kernels and the
# collectives. `make test MCORE=<version>` (a second megatron-core release, in CI
# after the default one) leaves them out with `-m "not mcore_independent"`: they would
# run the same code twice, and the CI's time goes to what does depend on the release.
MCORE_INDEPENDENT_DIRS = ("quant", "comm")
MCORE_DEPENDENT_FILES = ("test_comm_hosts.py",)  # resolves the layer's ranks per node


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        relative = os.path.relpath(str(item.fspath), TESTS_DIR).split(os.sep)
        if relative[0] in MCORE_INDEPENDENT_DIRS and relative[-1] not in MCORE_DEPENDENT_FILES:
            item.add_marker(pytest.mark.mcore_independent)
