#!/usr/bin/env bash
# Apply megatron_sdp4bit's patch to a Megatron-LM checkout, or take it out again:
#   scripts/apply_patches.sh /path/to/Megatron-LM
#   scripts/apply_patches.sh --revert /path/to/Megatron-LM
# The patch is chosen by the version in the checkout's megatron/core/package_info.py
# (one patch per supported Megatron-LM tag in patches/). Any other version, or a
# tree the chosen patch does not fit, is refused and nothing is changed; running it
# again on a patched tree (or --revert on an unpatched one) is a no-op.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
revert=0
if [ "${1:-}" = "--revert" ]; then
  revert=1
  shift
fi
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 [--revert] MEGATRON_LM_DIR" >&2
  exit 2
fi
tree="$1"
if [ ! -f "$tree/pretrain_gpt.py" ] || [ ! -d "$tree/megatron/training" ]; then
  echo "error: $tree does not look like a Megatron-LM checkout (no pretrain_gpt.py or megatron/training)" >&2
  exit 1
fi
info="$tree/megatron/core/package_info.py"
if [ ! -f "$info" ]; then
  echo "error: $info is missing: cannot tell which Megatron-LM version $tree is" >&2
  exit 1
fi
field() { sed -n "s/^$1 *= *['\"]\{0,1\}\([0-9A-Za-z]*\)['\"]\{0,1\}.*/\1/p" "$info" | head -n 1; }
version="$(field MAJOR).$(field MINOR).$(field PATCH)$(field PRE_RELEASE)"
# package_info.py version -> the Megatron-LM tag whose patch fits. (The tag
# core_v0.19.0 says 0.19.1 in its package_info.py.)
case "$version" in
  0.16.1) tag=core_v0.16.1 ;;
  0.17.1) tag=core_v0.17.1 ;;
  0.18.2) tag=core_v0.18.2 ;;
  0.19.1) tag=core_v0.19.0 ;;
  *)
    echo "error: $tree is Megatron-LM $version; patches exist for the tags core_v0.16.1," \
         "core_v0.17.1, core_v0.18.2 and core_v0.19.0 only. Check out one of them, use the" \
         "launcher route (python -m megatron_sdp4bit.launch), or make the few edits by hand" \
         "(see docs/megatron.md). Nothing was changed." >&2
    exit 1 ;;
esac
command -v patch >/dev/null || { echo "error: the patch tool is missing (apt-get install patch)" >&2; exit 1; }
p="$here/patches/megatron-lm-$tag-pretrain_gpt.patch"
name="$(basename "$p")"
fits() { patch --dry-run "$@" -p1 -F0 -s -f -d "$tree" < "$p" >/dev/null 2>&1; }
if [ "$revert" = 1 ]; then
  if fits -R; then
    patch -R -p1 -F0 -s -f --no-backup-if-mismatch -d "$tree" < "$p"
    echo "reverted: $name (pretrain_gpt.py is as it was before the patch)"
  elif fits; then
    echo "not applied: $name; nothing to revert"
  else
    echo "error: $name is neither applied to $tree nor fits it (made for Megatron-LM $tag, which" \
         "$version is); is pretrain_gpt.py edited since? Restore it with git (git -C $tree checkout" \
         "pretrain_gpt.py). Nothing was changed." >&2
    exit 1
  fi
  exit 0
fi
if fits -R; then
  echo "already applied: $name"
elif fits; then
  patch -p1 -F0 -s -f --no-backup-if-mismatch -d "$tree" < "$p"
  echo "applied: $name (Megatron-LM $version, tag $tag)"
else
  echo "error: $name does not fit $tree (made for Megatron-LM $tag, which $version is);" \
       "is pretrain_gpt.py edited? Apply its few lines by hand (see docs/megatron.md)." \
       "Nothing was changed." >&2
  exit 1
fi
