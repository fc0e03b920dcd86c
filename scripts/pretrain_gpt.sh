#!/usr/bin/env bash
# Pre-train one of the paper's GPT sizes with SDP4Bit on this node (or, with
# NNODES/NODE_RANK/MASTER_ADDR set, on several):
#   scripts/pretrain_gpt.sh 125m --data-path PREFIX --vocab-file V --merge-file M [more flags]
# Extra flags override configs/gpt_SIZE.yaml, e.g. --sdp4bit-preset baseline for the
# exact-collective baseline, or --sdp4bit-preset zeropp for ZeRO++'s qW + ULq.
# Tensor/pipeline parallel sizes come from the config (tensor_model_parallel_size,
# pipeline_model_parallel_size: 6.7b uses TP 4, as the paper's speed runs) unless the
# flags override them; the data-parallel size is what remains of
# NNODES x GPUS_PER_NODE, and SDP4Bit quantizes its collectives.
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 scripts/pretrain_gpt.sh 6.7b ...   (on node0)
#   NNODES=4 NODE_RANK=1 MASTER_ADDR=node0 scripts/pretrain_gpt.sh 6.7b ...   (on node1, ...)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -eq 0 ]; then
  echo "pretrain_gpt.sh: error: usage: $0 SIZE (125m|350m|1.3b|2.7b|6.7b) [flags]" >&2
  exit 2
fi
size="$1"
shift
# The project's Python: $PYTHON, else this checkout's .venv (what `make setup` makes),
# else python3 from PATH; one that cannot import the package is refused here, not by
# every rank after torchrun started.
if [ -n "${PYTHON:-}" ]; then
  python="$PYTHON"
elif [ -x "$here/.venv/bin/python" ]; then
  python="$here/.venv/bin/python"
else
  python="$(command -v python3 || command -v python || echo python3)"
fi
if ! "$python" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('megatron_sdp4bit') and u.find_spec('megatron.core')))" 2>/dev/null; then
  echo "pretrain_gpt.sh: error: $python cannot import megatron_sdp4bit and megatron-core: run" \
       "'make setup' in $here (it makes .venv), or set PYTHON to the interpreter that has them" >&2
  exit 2
fi
# The size's config, every flag (the driver's own parser), the node variables and
# TP/PP against the machines, checked once here before torchrun starts anything
# (megatron_sdp4bit/gpt_launch.py); it prints the layout and torchrun's node flags.
words="$("$python" -m megatron_sdp4bit.gpt_launch "$here/configs" "$size" "$@")" || exit $?
read -r -a node_flags <<< "$words"
exec "$python" -m torch.distributed.run "${node_flags[@]}" \
  -m megatron_sdp4bit.pretrain --config "$here/configs/gpt_${size}.yaml" "$@"
