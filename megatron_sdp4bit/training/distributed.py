"""Process groups and the parallel layout: NCCL on CUDA, gloo + the CPU backend otherwise.

The layout follows Megatron-LM's flags: ``--tensor-model-parallel-size`` (TP)
splits each layer's weights, ``--pipeline-model-parallel-size`` (PP) splits the
layers into stages, ``--num-layers-per-virtual-pipeline-stage`` cuts each stage
into interleaved model chunks (VP of them), and the remaining factor of the world
is the data-parallel size (DP), whose collectives SDP4Bit quantizes. Ranks are
ordered as megatron-core's default ``tp-cp-ep-dp-pp``: TP fastest, then DP, then PP.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_sdp4bit.comm import forget_subgroups
from megatron_sdp4bit.comm.backends import backend_of, host_collective_device
from megatron_sdp4bit.jobs import free_port
from megatron_sdp4bit.megatron import patch
from megatron_sdp4bit.megatron.background import runner_flag_refusal

from megatron_sdp4bit.training.arguments import ArgumentError, check_parallel_sizes


BACKENDS = ("nccl", "gloo")


class LauncherEnvironmentError(ValueError):
    """A launcher's variable (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) this process
    cannot run with; said by each process that has it (they may differ by rank)."""


@dataclass(frozen=True)
class ProcessPlacement:
    """Where this rank runs: its process-group backend, device type and GPU."""

    backend: str  # "nccl" or "gloo"
    device: str  # "cuda" or "cpu"
    gpu: Optional[int] = None  # this rank's CUDA device index (None on CPU)


def place_process(backend: Optional[str], cuda_devices: int, local_rank: int,
                  local_world_size: int) -> ProcessPlacement:
    """The backend and device of a rank (Megatron-LM's ``--distributed-backend``).

    ``backend`` None: NCCL where there are GPUs, gloo (with the CPU backend) where there
    are none. NCCL takes one GPU per rank; gloo on a GPU machine lets ranks share the
    visible GPUs (local rank r uses GPU r mod their count), which is how one GPU runs
    several data-parallel ranks. A combination that cannot start raises ``ArgumentError``
    naming the flag.
    """
    if backend is None:
        backend = "nccl" if cuda_devices else "gloo"
    if backend not in BACKENDS:
        raise ArgumentError(f"--distributed-backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if not cuda_devices:
        if backend == "nccl":
            raise ArgumentError("--distributed-backend nccl needs CUDA GPUs and this machine has none; "
                                "use gloo (the default without a GPU)")
        return ProcessPlacement("gloo", "cpu")
    if backend == "nccl" and local_world_size > cuda_devices:
        raise ArgumentError(
            f"{local_world_size} ranks on this node but {cuda_devices} GPU(s) visible: NCCL needs a "
            "GPU per rank; start at most that many ranks per node, or add --distributed-backend gloo "
            "to let ranks share GPUs (for checks: gloo stages every collective through host memory)")
    return ProcessPlacement(backend, "cuda", local_rank % cuda_devices)


def check_backend_layout(device: str, backend: str, layout: "ParallelLayout") -> None:
    """gloo on GPUs carries data parallelism only: the pipeline's sends and receives of CUDA
    tensors are not staged by gloo, and tensor parallelism over it is untested."""
    if device == "cuda" and backend == "gloo" and (layout.tensor > 1 or layout.pipeline > 1):
        raise ArgumentError(
            f"--distributed-backend gloo on GPUs runs data parallelism only (it is there to run "
            f"several data-parallel ranks on one GPU), not {layout.describe()}: use "
            "--distributed-backend nccl with one GPU per rank for tensor or pipeline parallelism")


def check_runner_flag(config, device: str, backend: str) -> None:
    """``--sdp4bit-runner`` naming a runner that cannot serve ``backend`` on ``device``
    (``megatron.background.runner_flag_refusal``), refused before the model is built."""
    refusal = runner_flag_refusal(config, backend, device)
    if refusal is not None:
        raise ArgumentError(refusal)


def init_distributed(backend: Optional[str] = None, timeout_minutes: float = 10.0) -> str:
    """Initialize torch.distributed from torchrun's variables (or as a single rank).

    ``backend``: ``--distributed-backend`` (``place_process``). Returns ``"cuda"`` or
    ``"cpu"``, the device the run uses. Without a GPU the run uses gloo and
    megatron_sdp4bit's CPU backend for megatron-core; with gloo on GPUs, tensors stay on
    the GPU and gloo copies them through host memory for each collective.
    """
    if "RANK" not in os.environ:  # plain `python -m ...`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world = launcher_int("RANK", 0), launcher_int("WORLD_SIZE", 1, minimum=1)
    local_rank = launcher_int("LOCAL_RANK", 0)
    local_world = launcher_int("LOCAL_WORLD_SIZE", world, minimum=1)
    if rank >= world or local_rank >= local_world:
        raise LauncherEnvironmentError(
            f"RANK={rank} of WORLD_SIZE={world} (LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world}) in "
            f"the environment: a rank must be below its size; {_LAUNCHERS}")
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placement = place_process(backend, cuda_devices, local_rank, local_world)
    if placement.device == "cuda":
        torch.cuda.set_device(placement.gpu)
    else:
        from megatron_sdp4bit.cpu_backend import enable_cpu_backend

        enable_cpu_backend()
    if not torch.distributed.is_initialized():
        _join(placement.backend, rank, world, timeout_minutes)
    return placement.device


_LAUNCHERS = "torchrun sets these variables for each rank; unset them to run one process"


def launcher_int(name: str, default: int, minimum: int = 0) -> int:
    """The launcher's variable ``name`` as an integer (``default`` when unset); one that
    is not (``LOCAL_WORLD_SIZE=abc``, left over in a shell) raises ``LauncherEnvironmentError``
    naming it, instead of ``invalid literal for int()``."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise LauncherEnvironmentError(f"{name}={value!r} in the environment is not an integer >= {minimum}: "
                                       f"{_LAUNCHERS}")
    return number


def _join(backend: str, rank: int, world: int, timeout_minutes: float) -> None:
    """The process group. Without torchrun (RANK and WORLD_SIZE set by hand, or left
    over in a shell), rank 0 says whom it waits for, and a world that never forms is
    one line at the timeout, not a silent wait ending in the store's traceback."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if world > 1 and rank == 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
        print(f"waiting up to {timeout_minutes:g} min for the {world - 1} other rank(s) of WORLD_SIZE={world} at "
              f"{where} (RANK and WORLD_SIZE are set in the environment; unset them to run one process)", flush=True)
    try:
        torch.distributed.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    except torch.distributed.DistError as error:  # the store's wait (rank 0) or connection (the others)
        if "timed out" not in str(error).lower():
            raise
        raise LauncherEnvironmentError(
            f"the {world} ranks of WORLD_SIZE={world} did not all join at {where} within {timeout_minutes:g} min "
            f"({str(error).strip().splitlines()[0]}): start every rank (torchrun does, setting RANK and "
            "WORLD_SIZE for each), or unset RANK and WORLD_SIZE to run one process") from None


def describe_placement(device: str) -> str:
    """The device line's words for this rank (after ``init_distributed``)."""
    if device == "cpu":
        return "cpu (gloo + CPU backend)"
    if backend_of(None, "cuda") == "gloo":
        return (f"cuda:{torch.cuda.current_device()} (gloo: ranks share the GPUs, each collective "
                "staged through host memory)")
    return "cuda (nccl)"


# --- the parallel layout ------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelLayout:
    """How the world is split. ``virtual`` is None without interleaving."""

    world: int
    tensor: int = 1
    pipeline: int = 1
    virtual: Optional[int] = None
    data: int = 1
    expert: int = 1  # expert-parallel ranks, carved out of the data-parallel ones

    @property
    def model_chunks(self) -> int:
        """Model chunks on each rank (one per virtual pipeline stage)."""
        return self.virtual or 1

    def describe(self) -> str:
        parts = [f"TP {self.tensor}", f"PP {self.pipeline}"]
        if self.virtual:
            parts.append(f"VP {self.virtual}")
        experts = f" (EP {self.expert} x expert DP {self.data // self.expert})" if self.expert > 1 else ""
        return " x ".join(parts) + f" x DP {self.data}{experts}"


def virtual_pipeline_size(args) -> Optional[int]:
    """Megatron-LM's rule: layers per stage / layers per virtual stage; 1 means no interleaving."""
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    if per_virtual is None:
        return None
    chunks = args.num_layers // args.pipeline_model_parallel_size // per_virtual
    return chunks if chunks > 1 else None


def parallel_layout(args, world_size: int) -> ParallelLayout:
    """The layout of ``args`` on ``world_size`` ranks; a bad one raises ``ArgumentError``
    with one line naming the flag. Also fills ``--global-batch-size`` and checks it
    against the data-parallel size (``arguments.check_parallel_sizes``)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--num-layers-per-virtual-pipeline-stage", per_virtual)):
        if value is not None and value < 1:
            raise ArgumentError(f"{flag} must be positive, got {value}")
    if args.num_attention_heads % tp:
        raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if args.ffn_hidden_size % tp:
        raise ArgumentError(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        raise ArgumentError(f"--num-layers {args.num_layers} is not divisible by "
                            f"--pipeline-model-parallel-size {pp}")
    if per_virtual is not None:
        if pp == 1:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs "
                                "--pipeline-model-parallel-size above 1 (it interleaves pipeline stages)")
        if args.num_layers % (pp * per_virtual):
            raise ArgumentError(
                f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp} x --num-layers-per-virtual-pipeline-stage {per_virtual} = {pp * per_virtual}")
    if world_size % (tp * pp):
        raise ArgumentError(
            f"the world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}")
    data, expert = world_size // (tp * pp), args.expert_model_parallel_size
    if data % expert:
        raise ArgumentError(
            f"the data-parallel size {data} is not divisible by --expert-model-parallel-size {expert} "
            "(expert-parallel groups are carved out of the data-parallel ranks)")
    layout = ParallelLayout(world=world_size, tensor=tp, pipeline=pp,
                            virtual=virtual_pipeline_size(args), data=data, expert=expert)
    check_parallel_sizes(args, layout.data)
    micro_batches = args.global_batch_size // (args.micro_batch_size * layout.data)
    if layout.virtual and micro_batches % pp:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} gives {micro_batches} micro-batches per "
            f"data-parallel rank; the interleaved schedule (--num-layers-per-virtual-pipeline-stage) "
            f"needs a multiple of --pipeline-model-parallel-size {pp}")
    return layout


def init_model_parallel(seed: int, layout: Optional[ParallelLayout] = None) -> None:
    """megatron's parallel state for ``layout`` (default: data parallelism only) and the
    seeds, as Megatron-LM sets them: ``seed + 100 x pipeline rank`` for torch's and
    megatron's RNG tracker (which adds the tensor-parallel rank where it should).

    A state made for another layout (an earlier run in the same processes) is replaced.
    """
    layout = layout or ParallelLayout(world=torch.distributed.get_world_size(),
                                      data=torch.distributed.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size() == layout.tensor
                and parallel_state.get_pipeline_model_parallel_world_size() == layout.pipeline
                and parallel_state.get_virtual_pipeline_model_parallel_world_size() == layout.virtual
                and parallel_state.get_expert_model_parallel_world_size() == layout.expert)
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            layout.tensor, layout.pipeline, virtual_pipeline_model_parallel_size=layout.virtual,
            expert_model_parallel_size=layout.expert)
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def parallel_ranks() -> dict:
    """This rank's coordinates: tensor, pipeline, data-parallel and expert-parallel rank."""
    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "ep_rank": parallel_state.get_expert_model_parallel_rank()}


def is_loss_rank() -> bool:
    """Whether this rank computes the loss (the last pipeline stage)."""
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def all_reduce_mean(value, weight: float = 1.0) -> float:
    """The weighted mean over all ranks of a float or one-element tensor (reads it on the
    host); ranks with ``weight`` 0 do not count, e.g. pipeline stages without the loss."""
    t = torch.tensor([float(value) * weight, weight], dtype=torch.float64, device=host_collective_device(None))
    torch.distributed.all_reduce(t)
    total, weights = t.tolist()
    return total / weights if weights else float("nan")


def all_reduce_sum(value: int, group=None) -> int:
    t = torch.tensor([int(value)], dtype=torch.int64, device=host_collective_device(group))
    torch.distributed.all_reduce(t, group=group)
    return int(t.item())


def shutdown() -> None:
    if torch.distributed.is_initialized():
        try:
            patch.uninstall()  # its runner's worker stops first: it may hold process groups
            parallel_state.destroy_model_parallel()
            forget_subgroups()  # no process group may outlive destroy_process_group
        finally:
            torch.distributed.destroy_process_group()
