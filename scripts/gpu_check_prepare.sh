#!/usr/bin/env bash
# Fill .gpu_carry/ (git-ignored) with what scripts/gpu_check.sh needs on the GPU machine,
# which has no internet and no megatron-core:
#   .gpu_carry/wheels/  megatron-core 0.16.1's cp312 wheel (its requirements torch, numpy
#                       and packaging are on the device image: /work/.library/device/KINDS.md)
#   .gpu_carry/corpus/  a small prebuilt embedded corpus (4 MB of the stdlib: tokenizer.json,
#                       stdlib_text_document.bin/.idx), so the check does not build one there
#   .gpu_carry/megatron-lm/  only with MEGATRON_LM_GIT: Megatron-LM's core_v0.16.1 files that
#                       step (g) runs (pretrain_gpt.py, its two builder modules, megatron/;
#                       7.6 MB), exported from that git directory of an NVIDIA/Megatron-LM
#                       clone (nothing is downloaded); then MEGATRON_LM_PATH=.gpu_carry/megatron-lm
# Then carry it: the device tool's carry list names ".gpu_carry" (docs/gpu_check.md).
#
#   scripts/gpu_check_prepare.sh           # about 15 s and a 2.6 MB download; re-running reuses both
#   MEGATRON_LM_GIT=~/Megatron-LM/.git scripts/gpu_check_prepare.sh   # also step (g)'s files
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
carry=.gpu_carry
py="${PYTHON:-}"
[ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }
mcore="megatron-core==0.16.1"
status=0

mkdir -p "$carry/wheels" "$carry/corpus"

# 1. the wheel, for CPython 3.12 on x86-64 Linux (the device's python3)
if compgen -G "$carry/wheels/megatron_core-0.16.1-cp312-*.whl" >/dev/null; then
  echo "wheel: already there: $(ls $carry/wheels/*.whl | xargs -n1 basename)"
else
  echo "wheel: downloading $mcore for cp312"
  if ! "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$carry/wheels" "$mcore"; then
    echo "error: pip could not download $mcore for cp312 (no network or no such wheel)" >&2
    status=1
  fi
fi
for whl in "$carry"/wheels/*.whl; do
  [ -f "$whl" ] || continue
  echo "  $(basename "$whl") requires (extras left out; all on the device image):"
  unzip -p "$whl" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/    /'
done

# 2. the corpus: built with this Python, used there through --data-path and
#    --tokenizer-model (the files do not depend on the Python version; only the
#    default cache folder's name does, which the check does not use)
if [ -f "$carry/corpus/stdlib_text_document.bin" ] && [ -f "$carry/corpus/tokenizer.json" ]; then
  echo "corpus: already there"
else
  echo "corpus: building 4 MB of the stdlib with $py"
  tmp="$(mktemp -d)"
  if PYTHONPATH="$root" PYTHONWARNINGS=ignore "$py" - "$tmp" "$carry/corpus" <<'EOF'
import os, shutil, sys
from megatron_sdp4bit.data.corpus import prepare_default_corpus, default_corpus_meta
prefix = prepare_default_corpus(cache_dir=sys.argv[1], max_mb=4)
folder, dest = os.path.dirname(prefix), sys.argv[2]
for name in ("tokenizer.json", "meta.json", "stdlib_text_document.bin", "stdlib_text_document.idx"):
    shutil.copy(os.path.join(folder, name), os.path.join(dest, name))
meta = default_corpus_meta(prefix)
print(f"  {meta['files']} files, {meta['bytes'] / 2**20:.1f} MiB of text, {meta['tokens']:,} tokens "
      f"(Python {meta['python']}), built in {meta['seconds_total']:.0f} s")
EOF
  then :; else
    echo "error: building the corpus failed" >&2
    status=1
  fi
  rm -rf "$tmp"
fi

# 3. Megatron-LM's files for step (g), from a local clone's git directory
if [ -n "${MEGATRON_LM_GIT:-}" ]; then
  tag=core_v0.16.1
  if [ -f "$carry/megatron-lm/pretrain_gpt.py" ]; then
    echo "megatron-lm: already there ($carry/megatron-lm)"
  elif ! git --git-dir "$MEGATRON_LM_GIT" rev-parse -q --verify "refs/tags/$tag" >/dev/null; then
    echo "error: MEGATRON_LM_GIT=$MEGATRON_LM_GIT is not a git directory with the tag $tag" >&2
    status=1
  else
    mkdir -p "$carry/megatron-lm"
    if git --git-dir "$MEGATRON_LM_GIT" archive "$tag" megatron pretrain_gpt.py gpt_builders.py \
        model_provider.py | tar -x -C "$carry/megatron-lm"; then
      echo "megatron-lm: $tag's pretrain_gpt.py, gpt_builders.py, model_provider.py, megatron/" \
        "($(du -sh "$carry/megatron-lm" | cut -f1)); run with MEGATRON_LM_PATH=$carry/megatron-lm"
    else
      echo "error: exporting $tag from $MEGATRON_LM_GIT failed" >&2
      rm -rf "$carry/megatron-lm"
      status=1
    fi
  fi
fi

git check-ignore -q "$carry" || echo "warning: $carry is not git-ignored: it would travel as part of the tree" >&2
echo "carry: $(du -sh "$carry" | cut -f1) in $carry (the device tool takes 64 MiB with the tree)"
exit $status
