"""The patch layer's state: one object, owned by the installed layer.

Per-bucket state is kept here, keyed weakly by megatron's bucket objects, rather
than as attributes stuck onto them: megatron's objects stay as megatron made them,
and a bucket that megatron drops takes its state with it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_sdp4bit.comm.accounting import WireRecorder
from megatron_sdp4bit.comm.rounding_streams import RoundingStreams
from megatron_sdp4bit.comm.runner import InlineRunner
from megatron_sdp4bit.comm.topology import default_ranks_per_node
from megatron_sdp4bit.comm.workspace import Workspace
from megatron_sdp4bit.config import SDP4BitConfig
from megatron_sdp4bit.megatron.config_refusals import check_ddp_for, check_optimizer_config
from megatron_sdp4bit.megatron.group_handle import WaitClock
from megatron_sdp4bit.megatron.quant_metrics import QuantErrorMetrics


@dataclass
class BucketState:
    """What the layer keeps for one of megatron's buckets."""

    main_shard: Optional[torch.Tensor] = None
    """This rank's exact fp32 main weights of the bucket (1/DP of it): qWD's target."""

    reconstructed: Optional[torch.Tensor] = None
    """fp32 params only: the shared reconstructed weights, set aside while the
    optimizer steps the exact ones in megatron's buffer."""

    unsent_main_weights: bool = False
    """The optimizer wrote new main weights that no all-gather has sent yet."""

    sample_error: bool = False
    """Measure this gather's weight quantization error (a metrics iteration)."""


@dataclass
class LayerState:
    config: SDP4BitConfig
    iteration: int = 0
    """Optimizer steps done (for ``grad_start_iter`` and the metrics interval): one per
    training iteration, also when megatron chains optimizers (``chain_depth``)."""
    in_optimizer_step: bool = False
    chain_depth: int = 0
    """Chained optimizers stepping now (MoE: a dense and an expert member; megatron may
    nest a chain in a chain): the outermost counts the iteration once when all its
    members are done, not each member or inner chain."""
    stepping_groups: frozenset = frozenset()
    """During a (sub-)optimizer's step: the ids of the bucket groups holding its buckets.
    A chained optimizer's members each sync every bucket group of the model chunk
    (megatron-core 0.16-0.19, without --overlap-param-gather): only their own are sent."""
    config_checked: bool = False
    """All ranks were checked to share ``config`` (a collective, done once)."""
    replica_checks_passed: int = 0
    """Run-time replica checks (``check_interval``) that found every replica alike."""
    grad_errors_sampled_at: int = -1
    """One gradient-error sample per iteration, not one per bucket group."""
    own_exact_collectives: bool = False
    """The layer issues the exact bucket collectives too, per bucket through ``comm``,
    because megatron's coalesced ones cannot run here (gloo on CUDA tensors). Decided
    once, when the first DDP model chunk is built."""
    metrics: QuantErrorMetrics = field(default_factory=QuantErrorMetrics)
    rounding_streams: RoundingStreams = field(default_factory=RoundingStreams)
    """This rank's stochastic-rounding streams (saved with the layer's checkpoint state)."""
    stream_names: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    """Each bucket group's rounding-stream name, numbered in construction order when DDP
    is built (``name_streams``)."""
    wire: WireRecorder = field(default_factory=WireRecorder)
    """The bytes of every bucket collective this layer ran or saw megatron run."""
    runner: object = field(default_factory=InlineRunner)
    """Where the layer's collectives run (``comm/runner.py``): a worker thread or a side
    stream when megatron overlaps them, else the caller (``megatron/background.py``)."""
    runner_chosen: bool = False
    """``runner`` was chosen (at the first DDP construction that overlaps)."""
    waits: WaitClock = field(default_factory=WaitClock)
    """How long megatron's thread waited on the layer's overlapped collectives
    (``wait_clock``: where that is the host's time)."""
    grad_workspace: Workspace = field(default_factory=Workspace)
    """The reduce-scatters' buffers, shared: the runner runs one collective at a time."""
    weight_workspace: Workspace = field(default_factory=Workspace)
    """The weight all-gathers' buffers, shared likewise."""
    warmed_up: set = field(default_factory=set)
    """The ``quant.KernelSpec``s compiled when DDP was built (``layer._warm_up_kernels``)."""
    warm_up_seconds: float = 0.0
    reference_on_cuda_said: bool = False  # ``layer.say_if_cuda_runs_reference``, once a run
    connected_groups: list = field(default_factory=list)
    """The process groups ``comm.connect`` opened at DDP construction (NCCL's lazy set-up
    done there, not in the first backward pass)."""
    """Time those compilations took (0 where the reference serves the device)."""
    buckets: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    grad_elements: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    """Gradient elements of each bucket group of the live model chunks that reduces over
    more than one rank (set at DDP construction): a sampled step's gradient-group sample
    is one budget spread over their sum (``sample_limit``), whatever the number of
    buckets."""
    prefetched: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    """Weight gathers submitted right after the optimizer step (--overlap-param-gather),
    by bucket group, until megatron starts them (``param_sync.prefetch_gathers``)."""

    refusals_passed: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    """Bucket groups (marked at DDP construction) and distributed optimizers (at their
    first step) whose configs passed the refusals, by the ``config`` they passed under
    (``refuse_once``)."""

    def refuse_once(self, adapter, owner, optimizer_config=None) -> None:
        """The refusals of ``owner``'s DDP config (a bucket group or a distributed
        optimizer, with its ``optimizer_config``), unless they passed under this config.
        A step calls it before it quantizes, for one reason: a second ``install()``
        replaces ``config`` (``patch.install``), also after a model was built under
        another; otherwise it is one dictionary look-up."""
        if self.refusals_passed.get(owner) is self.config:
            return
        check_ddp_for(self.config, adapter, adapter.ddp_config(owner))
        if self.config.enabled:
            check_optimizer_config(optimizer_config)
        self.refusals_passed[owner] = self.config

    def all_unsent(self, buckets) -> bool:
        """Every one of ``buckets`` holds new main weights no all-gather has sent yet."""
        return all(b in self.buckets and self.buckets[b].unsent_main_weights for b in buckets)

    def sample_limit(self, budget: int, numel: int) -> int:
        """Elements to sample of a gradient buffer of ``numel`` elements: its share of
        ``budget`` over the whole model's gradients (``grad_elements``), so that every
        buffer is sampled at the same stride."""
        total = sum(self.grad_elements.values())
        return budget * numel // total if total >= numel else budget

    def bucket(self, bucket) -> BucketState:
        state = self.buckets.get(bucket)
        if state is None:
            state = self.buckets[bucket] = BucketState()
        return state

    def name_streams(self, bucket_groups) -> None:
        """Give each new bucket group its own rounding streams, numbered in the order the
        model chunks and their groups are built (the same in every run of a model).
        Megatron starts the groups in another order in a process's first step (all at
        the end of the backward pass, dense before expert) than later (each when ready):
        with one stream for all, a resumed run's first step would hand the groups other
        noise than the uninterrupted run did at that step."""
        for bucket_group in bucket_groups:
            if bucket_group not in self.stream_names:
                self.stream_names[bucket_group] = f"bucket group {len(self.stream_names)}"

    def generator(self, device, purpose: str, bucket_group=None) -> Optional[torch.Generator]:
        """The rounding stream for ``purpose`` (``grads`` or ``weights``) of
        ``bucket_group`` (its own, once named by ``name_streams``) on ``device``; None
        with nearest rounding."""
        if self.config.rounding != "stochastic":
            return None
        name = self.stream_names.get(bucket_group) if bucket_group is not None else None
        stream = purpose if name is None else f"{purpose}/{name}"
        return self.rounding_streams.generator_for(device, self.config.seed, torch.distributed.get_rank(), stream)

    def resolve_ranks_per_node(self) -> None:
        """Decide ``config.ranks_per_node`` once, from the hosts the ranks run on (a given
        value or LOCAL_WORLD_SIZE must agree with them: ``comm/host_layout.py``), so that
        nothing below re-derives it or reads the environment per call. Collective over
        the world; needs torch.distributed."""
        if torch.distributed.is_initialized():
            self.config = self.config.replace(
                ranks_per_node=default_ranks_per_node(self.config.ranks_per_node))

    def wait_clock(self) -> Optional[WaitClock]:
        """The clock a handle megatron waits on reports to: only on a thread runner, where
        the wait blocks the host until the collective is done (``WaitClock``)."""
        return self.waits if self.runner.kind == "thread" else None

    def buffer_bytes(self) -> int:
        """Bytes of every reused collective buffer the layer holds now."""
        return self.grad_workspace.nbytes + self.weight_workspace.nbytes

    @property
    def exact_config(self) -> SDP4BitConfig:
        """``config`` with nothing quantized: the collectives of the layer's own exact path."""
        return self.config.replace(weight_mode="off", grad_mode="off")

    def grads_quantized_now(self) -> bool:
        return self.config.quantize_grads and self.iteration >= self.config.grad_start_iter
