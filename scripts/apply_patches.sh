#!/usr/bin/env bash
# Apply megatron_sdp4bit's patches to a Megatron-LM checkout (tag core_v0.16.1):
#   scripts/apply_patches.sh /path/to/Megatron-LM
# Refuses, changing nothing, when a patch does not fit the tree; re-running on an
# already patched tree is a no-op.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -ne 1 ]; then
  echo "usage: $0 MEGATRON_LM_DIR" >&2
  exit 2
fi
tree="$1"
if [ ! -f "$tree/pretrain_gpt.py" ] || [ ! -d "$tree/megatron/training" ]; then
  echo "error: $tree does not look like a Megatron-LM checkout (no pretrain_gpt.py or megatron/training)" >&2
  exit 1
fi
command -v patch >/dev/null || { echo "error: the patch tool is missing (apt-get install patch)" >&2; exit 1; }
status=0
for p in "$here"/patches/*.patch; do
  name="$(basename "$p")"
  if patch --dry-run -R -p1 -s -f -d "$tree" < "$p" >/dev/null 2>&1; then
    echo "already applied: $name"
  elif patch --dry-run -p1 -s -f -d "$tree" < "$p" >/dev/null 2>&1; then
    patch -p1 -s -f -d "$tree" < "$p"
    echo "applied: $name"
  else
    echo "error: $name does not fit $tree (made for Megatron-LM core_v0.16.1);" \
         "check out that tag or apply its few lines by hand (see docs/megatron.md)" >&2
    status=1
  fi
done
exit $status
