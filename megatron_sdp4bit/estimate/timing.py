"""Step time of one training step for the exact collectives, ZeRO++ and SDP4Bit.

The model, stated once:

- **Compute**: ``step FLOPs / (GPUs x TFLOP/s)`` (``model.step_flops``), times
  the 1F1B pipeline bubble ``1 + (PP - 1) / micro-batches``; or a measured
  compute time per step. Tensor-parallel communication is part of compute.
- **DP communication**, per bucket, all DP groups at once (they share each
  node's network link): the gradient reduce-scatter then the weight
  all-gather. Each phase takes ``max(bytes a GPU sends over its intra-node
  links / intra bandwidth, bytes a node sends over its network link /
  inter bandwidth)`` (``volume.Links``: rings for the exact collectives and
  every all-gather, direct sends for all-to-all hops). The two hops of a
  quantized reduce-scatter run one after the other, or with ``K`` pipeline
  chunks ``max(hop) + min(hop) / K``. Bandwidth only: no per-message latency.
- **Kernels**: the quantize/dequantize ops of each rank (``kernels.py``),
  never overlapped with compute (they share the device).
- **Overlap** (``none``, ``grads``, ``full``): ``none`` adds everything.
  ``grads`` hides bucket i's reduce-scatter under the backward pass of the
  buckets after it (Megatron's ``--overlap-grad-reduce``): exposed =
  ``max(comm / B, comm - backward x (B - 1) / B)`` with B buckets and
  backward = 2/3 of compute. ``full`` also hides the all-gather under the
  next forward pass (1/3 of compute; ``--overlap-param-gather``). This
  project's quantized reduce-scatter of bucket i starts its first chunk when
  the bucket is ready and the rest (inter-node hop included) when bucket i+1
  starts, which on a GPU enqueues them behind bucket i+1's backward work
  (``megatron/grad_sync.py``): all of it but the last bucket's can hide.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron_sdp4bit.config import SDP4BitConfig, preset
from megatron_sdp4bit.estimate import volume
from megatron_sdp4bit.comm.memory import LayerMemory, layer_memory
from megatron_sdp4bit.estimate.kernels import KernelModel
from megatron_sdp4bit.estimate.model import (ModelShape, bucket_numels, default_bucket_size,
                                             stage_params, step_flops)

OVERLAPS = ("none", "grads", "full")
GRAD_ELEMENT_SIZE = 4   # Megatron reduces gradients in fp32 (grad_reduce_in_fp32)
PARAM_ELEMENT_SIZE = 2  # bf16 model weights

VARIANTS: Dict[str, Tuple[str, str]] = {
    # name: (preset, label)
    "baseline": ("baseline", "exact: all-gather of the weights, fp32 reduce-scatter"),
    "zeropp": ("zeropp", "ZeRO++: qW 4-bit g2048 + ULq 4/4-bit g128"),
    "sdp4bit": ("sdp4bit", "SDP4Bit: qWD 4-bit g2048 + TLq-HS 8/4-bit g128, H32"),
}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    intra_gbps: float  # per GPU, each direction
    inter_gbps: float  # per node (all its NICs), each direction

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    global_batch: int
    micro_batch: int
    tflops: Optional[float] = None      # achieved per GPU on the model's FLOPs
    compute_s: Optional[float] = None   # or: measured compute seconds per step
    attention_flops: bool = False
    overlap: str = "none"
    bucket_size: Optional[int] = None   # None: megatron's (one bucket without overlap)
    exact_reduce_scatter: str = "ring"
    pipeline_chunks: Optional[int] = None  # override the presets' value (1)
    param_element_size: int = PARAM_ELEMENT_SIZE  # model weights: 2 (bf16) or 4 (fp32)


@dataclass
class VariantEstimate:
    name: str
    label: str
    config: SDP4BitConfig
    sent: volume.Sent               # per rank per step (accounting convention)
    grad_sent: volume.Sent
    weight_sent: volume.Sent
    node_inter_bytes: int           # busiest node's network bytes per step, one direction
    gpu_intra_bytes: int            # busiest GPU's intra-node bytes per step
    grad_comm_s: float
    weight_comm_s: float
    grad_exposed_s: float
    weight_exposed_s: float
    kernel_s: float
    compute_s: float
    kernel_ops: Dict[str, float] = field(default_factory=dict)  # op -> seconds per step
    memory: Optional[LayerMemory] = None  # what the layer adds on a GPU of the fullest stage

    @property
    def comm_s(self) -> float:
        return self.grad_comm_s + self.weight_comm_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.kernel_s + self.grad_exposed_s + self.weight_exposed_s


@dataclass
class Estimate:
    cluster: Cluster
    workload: Workload
    kernels: KernelModel
    flops: float
    compute_s: float
    compute_source: str
    microbatches: int
    buckets: Dict[int, List[int]]          # stage -> bucket numels
    layout_note: str
    variants: Dict[str, VariantEstimate]

    def speedup(self, name: str) -> float:
        return self.variants["baseline"].step_s / self.variants[name].step_s

    def tflops_per_gpu(self, name: str) -> float:
        return self.flops / self.cluster.world / self.variants[name].step_s / 1e12


class EstimateError(ValueError):
    """Inputs the model cannot take; ``flag`` names the command-line flag to change."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def _phase_seconds(links: volume.Links, cluster: Cluster) -> float:
    intra = links.max_gpu_intra * 8 / (cluster.intra_gbps * 1e9)
    inter = links.max_node_inter * 8 / (cluster.inter_gbps * 1e9)
    return max(intra, inter)


def _collective_seconds(phases: List[Tuple[str, volume.Links]], pipelined: int,
                        cluster: Cluster) -> float:
    """Seconds of one call's phases (two hops pipelined over ``pipelined`` chunks)."""
    times = [_phase_seconds(links, cluster) for _, links in phases]
    if len(times) == 2 and pipelined > 1:
        return max(times) + min(times) / pipelined
    return sum(times)


def _kernel_ops(shard: int, layout, config: SDP4BitConfig) -> Dict[str, int]:
    """Elements each kernel op of one bucket touches on one rank (fp32-equivalent)."""
    p = layout.dp_size
    ops: Dict[str, int] = {}
    if p == 1 or shard == 0:
        return ops
    if config.quantize_grads:
        hops = volume.hop_levels(layout)
        padded = sum(c.padded for c in volume.grad_chunks(shard, layout, config))
        first = "grad_first_quantize_hadamard" if config.use_hadamard else "grad_first_quantize_plain"
        ops[first] = p * padded
        if len(hops) == 2:
            ops["grad_requantize"] = p * padded            # L received chunks of N x chunk
            ops["grad_final_sum"] = hops[1][1] * padded    # N received chunks of one chunk
        else:
            ops["grad_final_sum"] = p * padded
    if config.quantize_weights:
        ops["weight_quantize_" + config.weight_mode] = shard
        ops["weight_apply_" + config.weight_mode] = p * shard
    return ops


def _exposed(comm: float, window: float, buckets: int) -> float:
    if buckets <= 1:
        return comm
    return max(comm / buckets, comm - window * (buckets - 1) / buckets)


def estimate(cluster: Cluster, workload: Workload, kernels: KernelModel,
             variants: Optional[List[str]] = None) -> Estimate:
    """Predict one training step of ``workload`` on ``cluster`` for each variant."""
    shape = workload.shape
    if cluster.world % (cluster.tp * cluster.pp):
        raise EstimateError("--tp", f"--tp {cluster.tp} x --pp {cluster.pp} does not divide the "
                            f"{cluster.world} GPUs ({cluster.nodes} nodes x {cluster.gpus_per_node})")
    dp = cluster.dp
    if workload.global_batch % (workload.micro_batch * dp):
        raise EstimateError("--global-batch-size", f"--global-batch-size {workload.global_batch} "
                            f"is not divisible by micro-batch {workload.micro_batch} x DP {dp}")
    microbatches = workload.global_batch // (workload.micro_batch * dp)
    flops = step_flops(shape, workload.global_batch, workload.attention_flops)
    if workload.compute_s is not None:
        compute_s = workload.compute_s
        source = f"measured: {compute_s:.4g} s per step (--compute-s)"
    else:
        bubble = 1 + (cluster.pp - 1) / microbatches
        compute_s = flops / cluster.world / (workload.tflops * 1e12) * bubble
        source = (f"{flops / 1e15:.4g} PFLOP per step / ({cluster.world} GPUs x "
                  f"{workload.tflops:g} TFLOP/s)" + (f" x pipeline bubble {bubble:.3g}"
                                                      if cluster.pp > 1 else ""))
    layouts = volume.dp_layouts(cluster.nodes, cluster.gpus_per_node, cluster.tp, cluster.pp)
    bucket_size = workload.bucket_size
    if bucket_size is None and workload.overlap != "none":
        bucket_size = default_bucket_size(dp)
    if workload.overlap == "none":
        bucket_size = None  # megatron: one bucket without --overlap-grad-reduce
    buckets = {}
    for stage in range(cluster.pp):
        size = bucket_size if stage == 0 else None  # megatron: no bucketing after stage 0
        buckets[stage] = bucket_numels(stage_params(shape, cluster.tp, cluster.pp, stage),
                                       dp, size)
    first_layout = layouts[0][1]
    note = _layout_note(cluster, first_layout, layouts)
    names = variants or list(VARIANTS)
    results = {}
    for name in names:
        preset_name, label = VARIANTS[name]
        config = preset(preset_name, **({"pipeline_chunks": workload.pipeline_chunks}
                                        if workload.pipeline_chunks else {}))
        results[name] = _variant(name, label, config, cluster, workload, kernels, layouts,
                                 buckets, compute_s)
    return Estimate(cluster, workload, kernels, flops, compute_s, source, microbatches,
                    buckets, note, results)


def _layout_note(cluster: Cluster, layout, layouts) -> str:
    groups = len(layouts)
    if layout.dp_size == 1:
        return "DP 1: no data-parallel communication"
    shape = (f"{layout.num_nodes} node(s) x {len(layout.nodes[0])} DP rank(s) per node"
             if layout.fallback_reason is None else "uneven over nodes: one flat level")
    hops = volume.hop_levels(layout)
    kind = {2: "two-level (intra, then inter-node all-to-all)",
            1: f"one {hops[0][0]}-node all-to-all level" if hops else ""}[len(hops)]
    return f"{groups} DP group(s) of {layout.dp_size}: {shape}; quantized reduce-scatter {kind}"


def _variant(name, label, config, cluster, workload, kernels, layouts, buckets,
             compute_s) -> VariantEstimate:
    grad_links = [volume.Links.empty(), volume.Links.empty()]  # per hop (exact: one phase)
    weight_links = volume.Links.empty()
    grad_phases = 0
    pipelined = 1
    kernel_ops: Dict[str, float] = {}
    per_stage_sent: Dict[int, Tuple[volume.Sent, volume.Sent]] = {}
    per_stage_kernel: Dict[int, Dict[str, float]] = {}
    for stage, layout in layouts:
        p = layout.dp_size
        for numel in buckets[stage]:
            shard = numel // p
            rs = volume.reduce_scatter_links(shard, GRAD_ELEMENT_SIZE, layout, config,
                                             workload.exact_reduce_scatter)
            for i, (_, links) in enumerate(rs.phases):
                grad_links[i].merge(links)
            grad_phases = max(grad_phases, len(rs.phases))
            pipelined = max(pipelined, rs.pipelined)
            for _, links in volume.all_gather_links(shard, workload.param_element_size, layout,
                                                    config).phases:
                weight_links.merge(links)
        if stage not in per_stage_sent:  # every DP group of a stage is alike: take its first
            rank = layout.ranks[0]
            g = w = volume.Sent()
            ops: Dict[str, float] = {}
            for numel in buckets[stage]:
                shard = numel // p
                g = g + volume.reduce_scatter_sent(shard, GRAD_ELEMENT_SIZE, layout, rank, config)
                w = w + volume.all_gather_sent(shard, workload.param_element_size, layout, rank,
                                               config)
                for op, elements in _kernel_ops(shard, layout, config).items():
                    ops[op] = ops.get(op, 0.0) + kernels.seconds(op, elements)
            per_stage_sent[stage] = (g, w)
            per_stage_kernel[stage] = ops
    # The busiest stage sets the pace (its DP traffic is the largest).
    stage = max(per_stage_sent, key=lambda s: per_stage_sent[s][0].exact_intra
                + per_stage_sent[s][0].exact_inter)
    grad_sent, weight_sent = per_stage_sent[stage]
    kernel_ops = per_stage_kernel[stage]
    phases = [("", grad_links[i]) for i in range(grad_phases)]
    grad_s = _collective_seconds(phases, pipelined, cluster)
    weight_s = _collective_seconds([("", weight_links)], 1, cluster)
    n_buckets = max(len(b) for b in buckets.values())
    backward, forward = compute_s * 2 / 3, compute_s / 3
    if workload.overlap == "none":
        grad_exposed, weight_exposed = grad_s, weight_s
    else:
        grad_exposed = _exposed(grad_s, backward, n_buckets)
        weight_exposed = (_exposed(weight_s, forward, n_buckets) if workload.overlap == "full"
                          else weight_s)
    memory = max((_stage_memory(stage, layout, buckets[stage], config, cluster, workload)
                   for stage, layout in layouts),
                  key=lambda m: m.per_param(m.total_bytes))
    all_links = volume.Links.empty()
    for links in grad_links + [weight_links]:
        all_links.merge(links)
    return VariantEstimate(
        name=name, label=label, config=config, sent=grad_sent + weight_sent,
        grad_sent=grad_sent, weight_sent=weight_sent,
        node_inter_bytes=all_links.max_node_inter, gpu_intra_bytes=all_links.max_gpu_intra,
        grad_comm_s=grad_s, weight_comm_s=weight_s, grad_exposed_s=grad_exposed,
        weight_exposed_s=weight_exposed, kernel_s=sum(kernel_ops.values()),
        compute_s=compute_s, kernel_ops=kernel_ops, memory=memory)


def _stage_memory(stage, layout, stage_buckets, config, cluster, workload) -> LayerMemory:
    """What the layer adds on a GPU of this stage's DP group (comm/memory.py)."""
    params = stage_params(workload.shape, cluster.tp, cluster.pp, stage).numel
    return layer_memory(stage_buckets, layout.dp_size, config, params=params,
                        node_members=len(layout.nodes[0]) if layout.is_two_level else 0,
                        fp32_params=workload.param_element_size == 4,
                        grad_bytes=GRAD_ELEMENT_SIZE,
                        overlap_grad_reduce=workload.overlap != "none",
                        overlap_param_gather=workload.overlap == "full")
