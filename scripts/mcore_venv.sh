#!/usr/bin/env bash
# Fill a test virtualenv with a given megatron-core release (called by
# `make ... MCORE=<version>` after torch is in place).
#
#   scripts/mcore_venv.sh VENV_PYTHON VERSION
#
# - torch stays what the venv has: a constraint pins it, so megatron-core's
#   `torch>=2.6` can never pull a multi-GB CUDA build instead.
# - megatron-core >= 0.17 declares Requires-Python >=3.12 but runs on 3.11 once
#   `typing.override` exists; on 3.11 it is installed with
#   --ignore-requires-python and a .pth file in THIS venv's site-packages adds
#   typing.override from typing_extensions at start-up. The shim is a test-
#   environment fix only: it is never part of the package that users install.
set -euo pipefail
py=$1
version=$2
# Refuse, before installing anything, a release without an adapter (the list lives in
# adapters/__init__.py, which imports nothing but the standard library).
"$py" - "$version" <<'PY'
import runpy, sys
adapters = runpy.run_path("megatron_sdp4bit/megatron/adapters/__init__.py")
version = sys.argv[1]
if adapters["minor_of"](version) not in adapters["ADAPTER_MODULES"]:
    sys.exit(f"MCORE={version}: not a supported megatron-core release; supported: "
             f"{', '.join(adapters['ADAPTER_MODULES'])}")
PY
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')" > "$constraints"
if "$py" -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
  # Python 3.11: everything else resolves as usual (--ignore-requires-python for
  # all would pick releases of matplotlib's deps that really need 3.12); then
  # megatron-core alone, over the 0.16.1 that the first step resolved to.
  "$py" -m pip install -q -c "$constraints" -e ".[test,plots]" "packaging>=24.2"
  "$py" -m pip install -q --ignore-requires-python --no-deps "megatron-core==$version"
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo 'import typing, typing_extensions; typing.override = getattr(typing, "override", typing_extensions.override)' \
    > "$site/sdp4bit_test_typing_override.pth"
else
  "$py" -m pip install -q -c "$constraints" -e ".[test,plots]" "megatron-core==$version"
fi
"$py" -c "import megatron.core as m; assert m.__version__.split('+')[0] == '$version', m.__version__; print('megatron-core', m.__version__, 'ready in', '$py')"
