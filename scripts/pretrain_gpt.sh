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
size="${1:?usage: $0 SIZE (125m|350m|1.3b|2.7b|6.7b) [flags]}"
shift
config="$here/configs/gpt_${size}.yaml"
[ -f "$config" ] || { echo "no config for size '$size' ($config)" >&2; exit 2; }
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
gpus="${GPUS_PER_NODE:-$("$python" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
nnodes="${NNODES:-1}"

# TP and PP as the driver will see them (the last --flag on the command line wins over
# the config), checked against the machines before torchrun starts anything.
read -r tp pp < <("$python" - "$config" "$@" <<'EOF'
import sys

import yaml

config = yaml.safe_load(open(sys.argv[1])) or {}
sizes = {"tensor": int(config.get("tensor_model_parallel_size", 1)),
         "pipeline": int(config.get("pipeline_model_parallel_size", 1))}
argv = sys.argv[2:]
for i, arg in enumerate(argv):
    for kind in sizes:
        flag = f"--{kind}-model-parallel-size"
        if arg == flag and i + 1 < len(argv):
            sizes[kind] = int(argv[i + 1])
        elif arg.startswith(flag + "="):
            sizes[kind] = int(arg.split("=", 1)[1])
print(sizes["tensor"], sizes["pipeline"])
EOF
)
[ -n "${tp:-}" ] && [ -n "${pp:-}" ] || { echo "could not read the parallel sizes of $config" >&2; exit 2; }
world=$((nnodes * gpus))
if (( gpus % tp )); then
  echo "$size: --tensor-model-parallel-size $tp does not divide the $gpus GPUs of a node" \
       "(tensor parallelism stays inside a node); set GPUS_PER_NODE or pass another size" >&2
  exit 2
fi
if (( world % (tp * pp) )); then
  echo "$size: $nnodes node(s) x $gpus GPUs = $world ranks is not divisible by" \
       "--tensor-model-parallel-size $tp x --pipeline-model-parallel-size $pp" >&2
  exit 2
fi
echo "GPT-$size: TP $tp x PP $pp x DP $((world / (tp * pp))) on $nnodes node(s) x $gpus GPUs" >&2
exec "$python" -m torch.distributed.run --nnodes "$nnodes" --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  --nproc-per-node "$gpus" -m megatron_sdp4bit.pretrain --config "$config" "$@"
