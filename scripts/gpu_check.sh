#!/usr/bin/env bash
# One command for a lent GPU machine (one H100/H200): environment, Triton kernels,
# large bit-identity, kernel speed table, the training driver (sdp4bit / baseline /
# zeropp, step times side by side) and, with MEGATRON_LM_PATH, Megatron-LM's own
# pretrain_gpt.py. Prints PASS/FAIL/SKIP per step and a summary; exits non-zero if
# any step FAILED. See docs/gpu_check.md (the device-tool call, what each step checks).
#
#   scripts/gpu_check.sh                 # on the GPU machine; results to $OUT, else runs/gpu-check-<date>/
#   scripts/gpu_check.sh --cpu-smoke     # the self-test: every step on CPU, tiny sizes (~1 min)
#   scripts/gpu_check.sh --steps env,train
#
# Before the call, here: scripts/gpu_check_prepare.sh fills .gpu_carry/ (the
# megatron-core wheel for Python 3.12, a small prebuilt corpus); carry it.
# Environment: PYTHON (default .venv/bin/python if present, else python3),
# GPU_CHECK_SITE (where carried wheels are installed, default /tmp/gpu-check-site),
# GPU_CHECK_CORPUS (a corpus folder instead of .gpu_carry/corpus), MEGATRON_LM_PATH.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
export PYTHONUNBUFFERED=1

if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python3
fi
if ! command -v "$py" >/dev/null 2>&1; then
  echo "gpu_check: error: no Python at '$py' (set PYTHON)" >&2
  exit 2
fi

out="${OUT:-}"
if [ -z "$out" ]; then
  out="runs/gpu-check-$(date +%Y%m%d-%H%M%S)"
fi
mkdir -p "$out" || { echo "gpu_check: error: cannot create $out" >&2; exit 2; }
log="$out/gpu_check.log"

# megatron-core: when it is not installed, install the carried wheels (no index, no deps:
# their requirements torch, numpy and packaging are on the device image).
export GPU_CHECK_WHEELS="megatron-core found"
if ! "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron.core') is None)" 2>/dev/null; then
  GPU_CHECK_WHEELS="megatron-core missing and no wheels in .gpu_carry/wheels or .whl"
  site="${GPU_CHECK_SITE:-/tmp/gpu-check-site}"
  for dir in .gpu_carry/wheels .whl; do
    compgen -G "$dir/*.whl" >/dev/null || continue
    echo "gpu_check: megatron-core is not installed; installing $dir/*.whl into $site" | tee -a "$log"
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$dir"/*.whl 2>&1 | tee -a "$log"; then
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
      GPU_CHECK_WHEELS="installed $(ls "$dir"/*.whl | xargs -n1 basename | tr '\n' ' ')from $dir"
    else
      GPU_CHECK_WHEELS="pip install of $dir/*.whl failed (see the log)"
    fi
    break
  done
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

"$py" scripts/gpu_check_steps.py --out "$out" "$@" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
echo "gpu_check: exit $status; log $log, results $out/gpu_check.json" | tee -a "$log"
exit "$status"
