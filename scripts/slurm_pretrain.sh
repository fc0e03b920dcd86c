#!/usr/bin/env bash
# Pre-train on a Slurm cluster: the driver (python -m megatron_sdp4bit.pretrain), or
# Megatron-LM's pretrain_gpt.py through megatron_sdp4bit.launch (MEGATRON_LM=checkout).
#
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 scripts/slurm_pretrain.sh torchrun FLAGS...
#       one task per node; each starts torchrun, which starts one rank per GPU
#   sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 scripts/slurm_pretrain.sh tasks FLAGS...
#       srun alone, one task per GPU: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID become
#       RANK/WORLD_SIZE/LOCAL_RANK (and SLURM_NTASKS_PER_NODE LOCAL_WORLD_SIZE)
#   MEGATRON_LM=/path/to/Megatron-LM sbatch ... scripts/slurm_pretrain.sh torchrun \
#       <Megatron-LM arguments> --use-distributed-optimizer --sdp4bit
#
# The layer learns which ranks share a node from the hosts themselves at install (one
# all-gather of hostname + boot id; SDP4BIT_HOST_ID overrides it), and refuses in one
# line a layout it cannot serve (nodes of unequal rank counts, ranks not placed in
# blocks per node). SDP4BIT_DRY_RUN=1 prints the srun command instead of running it.
# Environment: PYTHON (default python3), GPUS_PER_NODE (default SLURM_GPUS_ON_NODE),
# MASTER_ADDR (default the job's first node), MASTER_PORT (default 29500).
#SBATCH --job-name=sdp4bit
#SBATCH --exclusive
set -euo pipefail

usage="usage: $0 torchrun|tasks [flags of the driver, or of Megatron-LM's pretrain_gpt.py]"
if [ $# -eq 0 ]; then
  echo "slurm_pretrain.sh: error: $usage" >&2
  exit 2
fi
mode="$1"
shift
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "slurm_pretrain.sh: error: not inside a Slurm job (no SLURM_JOB_ID): start it with sbatch or salloc" >&2
  exit 2
fi
python="${PYTHON:-python3}"
master_addr="${MASTER_ADDR:-}"
if [ -z "$master_addr" ]; then  # the job's first node (no pipe into head: SIGPIPE under pipefail)
  nodes="$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}")"
  master_addr="${nodes%%$'\n'*}"
fi
master_port="${MASTER_PORT:-29500}"

# What each rank runs: the driver, or Megatron-LM's script through the launcher.
if [ -n "${MEGATRON_LM:-}" ]; then
  entry=(-m megatron_sdp4bit.launch "$MEGATRON_LM/pretrain_gpt.py")
else
  entry=(-m megatron_sdp4bit.pretrain)
fi

case "$mode" in
  torchrun)
    gpus="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
    if [ -z "$gpus" ]; then
      echo "slurm_pretrain.sh: error: torchrun: how many GPUs a node has is unknown: sbatch --gpus-per-node=N, or set GPUS_PER_NODE" >&2
      exit 2
    fi
    # c10d rendezvous: every node's torchrun meets at the first node; ranks of one node
    # come out consecutive, as the two-level collectives need.
    command=(srun --ntasks-per-node=1 --kill-on-bad-exit=1
             "$python" -m torch.distributed.run
             --nnodes "${SLURM_NNODES:?}" --nproc-per-node "$gpus"
             --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port" --rdzv-id "$SLURM_JOB_ID"
             "${entry[@]}" "$@")
    ;;
  tasks)
    if [ -z "${SLURM_NTASKS_PER_NODE:-}" ]; then
      echo "slurm_pretrain.sh: error: tasks: give sbatch --ntasks-per-node=GPUS (one task per GPU)" >&2
      exit 2
    fi
    # The mapping runs inside each task, where Slurm sets that task's variables; block
    # distribution keeps each node's ranks consecutive.
    # shellcheck disable=SC2016  # expanded by the task's shell, not this one
    task_env='export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID" LOCAL_WORLD_SIZE="$SLURM_NTASKS_PER_NODE"; exec "$@"'
    command=(srun --distribution=block --kill-on-bad-exit=1
             env MASTER_ADDR="$master_addr" MASTER_PORT="$master_port"
             bash -c "$task_env" sdp4bit-task "$python" "${entry[@]}" "$@")
    ;;
  *)
    echo "slurm_pretrain.sh: error: unknown mode '$mode'; $usage" >&2
    exit 2
    ;;
esac

if [ -n "${SDP4BIT_DRY_RUN:-}" ]; then
  printf '%q ' "${command[@]}"
  printf '\n'
  exit 0
fi
exec "${command[@]}"
