#!/usr/bin/env bash
# Pre-train one of the paper's GPT sizes with SDP4Bit on this node (or, with
# NNODES/NODE_RANK/MASTER_ADDR set, on several):
#   scripts/pretrain_gpt.sh 125m --data-path PREFIX --vocab-file V --merge-file M [more flags]
# Extra flags override configs/gpt_SIZE.yaml, e.g. --sdp4bit-preset baseline for the
# exact-collective baseline, or --sdp4bit-preset zeropp for ZeRO++'s qW + ULq.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
size="${1:?usage: $0 SIZE (125m|350m|1.3b|2.7b|6.7b) [flags]}"
shift
config="$here/configs/gpt_${size}.yaml"
[ -f "$config" ] || { echo "no config for size '$size' ($config)" >&2; exit 2; }
gpus="${GPUS_PER_NODE:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  --nproc-per-node "$gpus" -m megatron_sdp4bit.pretrain --config "$config" "$@"
