"""Step time of one training step for the exact collectives, ZeRO++ and SDP4Bit.

The model, stated once (docs/performance.md, "Estimator"):

- **Compute**: ``step FLOPs / (GPUs x TFLOP/s)`` (``model.step_flops``), times
  the 1F1B pipeline bubble ``1 + (PP - 1) / micro-batches``; or a measured
  compute time per step (``--compute-s``, which then includes everything below
  that is not data-parallel). With a TFLOP/s rate, the tensor-parallel
  all-reduces are added (``model.tp_allreduces``: four per layer and
  micro-batch, plus the embedding's and the output layer's, of seq x
  micro-batch x hidden activations, ring all-reduces over the intra-node
  links, not overlapped).
- **DP communication**, per bucket, all DP groups at once (they share each
  node's network link): the gradient reduce-scatter then the weight
  all-gather. Each phase takes ``network.Network.phase_seconds`` of its link
  bytes (``volume.Links``: rings for the exact collectives and every
  all-gather, direct sends for all-to-all hops), plus the latency of its calls
  and messages (``calls.py``, ``network.Latency``). The two hops of a quantized
  reduce-scatter run one after the other, or with ``K`` pipeline chunks
  ``max(hop) + min(hop) / K``. With PP > 1 and tied embeddings, megatron's
  all-reduce of the embedding gradients between the first and last stage
  follows (``volume.embedding_allreduce_links``).
- **Kernels**: the quantize/dequantize ops of each rank and the reduce-scatter's
  staging copy (``kernels.py``); without overlap they add to the step.
- **Overlap** (``none``, ``grads``, ``full``): what the layer's runner hides behind
  the passes (``overlap.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from megatron_sdp4bit.comm.layout import ONE_QUEUE_WHOLE_BUCKET_ELEMENTS
from megatron_sdp4bit.comm.memory_plan import LayerMemory, layer_memory
from megatron_sdp4bit.config import SDP4BitConfig, preset
from megatron_sdp4bit.estimate import calls, overlap, volume
from megatron_sdp4bit.estimate.implementation import THIS_PROJECT, Implementation
from megatron_sdp4bit.estimate.kernels import KernelModel
from megatron_sdp4bit.estimate.gpt_shape import (ModelShape, bucket_numels, default_bucket_size,
                                             stage_params, step_flops, tp_allreduces)
from megatron_sdp4bit.estimate.network import (NCCL_LATENCY, Calls, Latency, Network,
                                               ring_calls)

OVERLAPS = ("none", "grads", "full")
RUNNERS = ("stream", "deferred")  # the layer's runners on NCCL (comm/runner_choice.py)
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
    inter_gbps: float  # per node (all its NICs, what they reach together), each direction
    stream_gbps: Optional[float] = None  # most one stream reaches per node (network.py)
    latency: Latency = NCCL_LATENCY

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def network(self) -> Network:
        return Network(self.intra_gbps, self.inter_gbps, self.stream_gbps, self.latency)


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
    implementation: Implementation = THIS_PROJECT
    runner: str = "stream"
    """With overlap, the layer's runner on NCCL: ``stream`` (a side stream: every stage of
    a collective issued when megatron starts it) or ``deferred`` (one hardware queue,
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which megatron asks for under tensor parallelism
    before Blackwell: stages issued at megatron's later calls, a bucket of up to
    ``ONE_QUEUE_WHOLE_BUCKET_ELEMENTS`` in one chunk; ``comm/deferring_runner.py``)."""


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
    grad_comm_s: float              # bandwidth + latency
    weight_comm_s: float
    grad_latency_s: float           # of which latency (calls and messages)
    weight_latency_s: float
    grad_exposed_s: float
    weight_exposed_s: float
    kernel_s: float                 # kernels outside an overlapped chain (else in *_exposed_s)
    compute_s: float
    tp_comm_s: float = 0.0          # tensor-parallel all-reduces (with a TFLOP/s rate)
    embedding_s: float = 0.0        # tied-embedding gradient all-reduce (PP > 1)
    kernel_ops: Dict[str, float] = field(default_factory=dict)  # op -> seconds per step
    memory: Optional[LayerMemory] = None  # what the layer adds on a GPU of the fullest stage

    @property
    def comm_s(self) -> float:
        return self.grad_comm_s + self.weight_comm_s

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.kernel_s + self.grad_exposed_s
                + self.weight_exposed_s + self.embedding_s)


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

    @property
    def one_queue_chunked_buckets(self) -> int:
        """Buckets the runner for one hardware queue cannot take whole (above its
        ``whole_bucket_elements``): their chunks wait for one another inside one call,
        holding up the pass (``one_queue.py``)."""
        limit = self.workload.implementation.whole_bucket_elements
        if limit is None:
            return 0
        return sum(n > limit for numels in self.buckets.values() for n in numels)

    def tflops_per_gpu(self, name: str) -> float:
        return self.flops / self.cluster.world / self.variants[name].step_s / 1e12


class EstimateError(ValueError):
    """Inputs the model cannot take; ``flag`` names the command-line flag to change."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def _collective_seconds(phases: List[volume.Links], pipelined: int, network: Network) -> float:
    """Bandwidth seconds of one call's phases (two hops pipelined over ``pipelined`` chunks)."""
    times = [network.phase_seconds(links) for links in phases]
    if len(times) == 2 and pipelined > 1:
        return max(times) + min(times) / pipelined
    return sum(times)


def _kernel_ops(shard: int, layout, config: SDP4BitConfig,
                impl: Implementation) -> Dict[str, int]:
    """Elements each kernel op of one bucket touches on one rank (fp32-equivalent)."""
    p = layout.dp_size
    ops: Dict[str, int] = {}
    if p == 1 or shard == 0:
        return ops
    if config.quantize_grads:
        hops = volume.hop_levels(layout)
        padded = sum(c.padded for c in volume.grad_chunks(shard, layout, config, impl))
        staged = calls.staging_elements(shard, layout, config, impl)
        if staged:
            ops["grad_stage_rows"] = staged
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


def _compute(cluster: Cluster, workload: Workload, microbatches: int) -> Tuple[float, float, str]:
    """(compute seconds, tensor-parallel all-reduce seconds, where compute came from)."""
    flops = step_flops(workload.shape, workload.global_batch, workload.attention_flops)
    if workload.compute_s is not None:
        return (workload.compute_s, 0.0, f"measured: {workload.compute_s:.4g} s per step "
                "(--compute-s; includes the tensor-parallel all-reduces)")
    bubble = 1 + (cluster.pp - 1) / microbatches
    compute_s = flops / cluster.world / (workload.tflops * 1e12) * bubble
    source = (f"{flops / 1e15:.4g} PFLOP per step / ({cluster.world} GPUs x "
              f"{workload.tflops:g} TFLOP/s)" + (f" x pipeline bubble {bubble:.3g}"
                                                  if cluster.pp > 1 else ""))
    return compute_s, _tp_seconds(cluster, workload, microbatches), source


def _tp_seconds(cluster: Cluster, workload: Workload, microbatches: int) -> float:
    """The tensor-parallel all-reduces of one step on one GPU (ring within the node)."""
    t = cluster.tp
    if t == 1:
        return 0.0
    count = tp_allreduces(workload.shape, cluster.pp) * microbatches
    shape = workload.shape
    nbytes = shape.seq_length * workload.micro_batch * shape.hidden_size * workload.param_element_size
    sent = 2 * (t - 1) / t * nbytes
    if t <= cluster.gpus_per_node:
        rate, steps = cluster.intra_gbps, ring_calls(t, 1, rounds=2)
    else:  # TP across nodes: the node's network link, shared by its GPUs
        nodes = t // cluster.gpus_per_node
        rate, steps = cluster.inter_gbps / cluster.gpus_per_node, ring_calls(t, nodes, rounds=2)
    per_call = sent * 8 / (rate * 1e9) + cluster.latency.seconds(steps)
    return count * per_call


def _buckets(cluster: Cluster, workload: Workload) -> Dict[int, List[int]]:
    bucket_size = workload.bucket_size
    if bucket_size is None and workload.overlap != "none":
        bucket_size = default_bucket_size(cluster.dp)
    if workload.overlap == "none":
        bucket_size = None  # megatron: one bucket without --overlap-grad-reduce
    buckets = {}
    for stage in range(cluster.pp):
        size = bucket_size if stage == 0 else None  # megatron: no bucketing after stage 0
        buckets[stage] = bucket_numels(stage_params(workload.shape, cluster.tp, cluster.pp, stage),
                                       cluster.dp, size)
    return buckets


def estimate(cluster: Cluster, workload: Workload, kernels: KernelModel,
             variants: Optional[List[str]] = None) -> Estimate:
    """Predict one training step of ``workload`` on ``cluster`` for each variant."""
    if cluster.world % (cluster.tp * cluster.pp):
        raise EstimateError("--tp", f"--tp {cluster.tp} x --pp {cluster.pp} does not divide the "
                            f"{cluster.world} GPUs ({cluster.nodes} nodes x {cluster.gpus_per_node})")
    _check_tensor_parallel_groups(cluster)
    workload = _with_runner(workload)
    dp = cluster.dp
    if workload.global_batch % (workload.micro_batch * dp):
        raise EstimateError("--global-batch-size", f"--global-batch-size {workload.global_batch} "
                            f"is not divisible by micro-batch {workload.micro_batch} x DP {dp}")
    microbatches = workload.global_batch // (workload.micro_batch * dp)
    flops = step_flops(workload.shape, workload.global_batch, workload.attention_flops)
    compute_s, tp_s, source = _compute(cluster, workload, microbatches)
    layouts = volume.dp_layouts(cluster.nodes, cluster.gpus_per_node, cluster.tp, cluster.pp)
    buckets = _buckets(cluster, workload)
    note = _layout_note(layouts)
    embedding_s = _embedding_seconds(cluster, workload)
    results = {}
    for name in variants or list(VARIANTS):
        preset_name, label = VARIANTS[name]
        config = preset(preset_name, **({"pipeline_chunks": workload.pipeline_chunks}
                                        if workload.pipeline_chunks else {}))
        results[name] = _variant(name, label, config, cluster, workload, kernels, layouts,
                                 buckets, (compute_s, tp_s, embedding_s, microbatches))
    return Estimate(cluster, workload, kernels, flops, compute_s, source, microbatches,
                    buckets, note, results)


def _with_runner(workload: Workload) -> Workload:
    """``workload`` with its implementation's chunking on its runner: the runner for one
    hardware queue takes buckets of up to ``ONE_QUEUE_WHOLE_BUCKET_ELEMENTS`` whole.
    Without overlap megatron runs no runner (the collectives run on the caller)."""
    if workload.runner not in RUNNERS:
        raise EstimateError("--runner", f"--runner {workload.runner!r}: use one of "
                            + ", ".join(RUNNERS))
    if workload.runner != "deferred" or workload.overlap == "none":
        return workload
    if workload.implementation.max_chunk_elements is None:
        raise EstimateError("--runner", f"--runner deferred is this project's runner for one "
                            f"hardware queue; {workload.implementation.name} has none: pass "
                            "--runner stream or --implementation megatron_sdp4bit")
    impl = replace(workload.implementation, whole_bucket_elements=ONE_QUEUE_WHOLE_BUCKET_ELEMENTS)
    return replace(workload, implementation=impl)


def _check_tensor_parallel_groups(cluster: Cluster) -> None:
    """Refuse a TP size that cuts a node's GPUs unevenly: some tensor-parallel groups
    would then straddle two nodes (their all-reduces crossing the network at
    every layer), a layout this model does not cost and ``scripts/pretrain_gpt.sh``
    does not launch. TP that divides the GPUs of a node, or spans whole nodes, is
    costed (``_tp_seconds``)."""
    tp, per_node = cluster.tp, cluster.gpus_per_node
    if per_node % tp == 0 or tp % per_node == 0:
        return
    first = next(g for g in range(cluster.world // tp)
                 if (g * tp) // per_node != (g * tp + tp - 1) // per_node)
    low, high = first * tp, first * tp + tp - 1
    divisors = ", ".join(str(d) for d in range(1, per_node + 1) if per_node % d == 0)
    raise EstimateError("--tp", f"--tp {tp} does not divide the {per_node} GPUs of a node "
                        f"(--gpus-per-node): tensor-parallel group {first} (ranks {low}-{high}) would "
                        f"straddle nodes {low // per_node} and {high // per_node}, which this "
                        f"estimate does not cost; pass a --tp that divides {per_node} ({divisors}) "
                        f"or a multiple of it")


def _layout_note(layouts) -> str:
    layout = layouts[0][1]
    if layout.dp_size == 1:
        return "DP 1: no data-parallel communication"
    shape = (f"{layout.num_nodes} node(s) x {len(layout.nodes[0])} DP rank(s) per node"
             if layout.fallback_reason is None else
             "uneven over nodes: one flat level, which the layer runs only with "
             "--sdp4bit-ranks-per-node 1 (it refuses this layout otherwise)")
    hops = volume.hop_levels(layout)
    kind = {2: "two-level (intra, then inter-node all-to-all)",
            1: f"one {hops[0][0]}-node all-to-all level" if hops else ""}[len(hops)]
    return f"{len(layouts)} DP group(s) of {layout.dp_size}: {shape}; quantized reduce-scatter {kind}"


def _embedding_seconds(cluster: Cluster, workload: Workload) -> float:
    """Megatron's all-reduce of the tied word embeddings' gradients (first and last stage)."""
    shape = workload.shape
    if cluster.pp == 1 or shape.untied_embeddings:
        return 0.0
    dp, tp, last = cluster.dp, cluster.tp, cluster.pp - 1
    pairs = [(t + tp * d, t + tp * (d + dp * last)) for d in range(dp) for t in range(tp)]
    numel = shape.padded_vocab(tp) * shape.hidden_size // tp
    links = volume.embedding_allreduce_links(pairs, numel, GRAD_ELEMENT_SIZE, cluster.gpus_per_node)
    nodes = len({r // cluster.gpus_per_node for r in pairs[0]})
    steps = ring_calls(2, nodes, rounds=2)
    return cluster.network.phase_seconds(links) + cluster.latency.seconds(steps)


@dataclass
class _Traffic:
    """One variant's step on the links: per phase, calls per rank, sent bytes, kernels."""

    grad_phases: List[volume.Links]
    weight: volume.Links              # the weight gather's hops together
    weight_phases: List[volume.Links]  # each hop of it
    pipelined: int
    grad_calls: Calls
    weight_calls: Calls
    grad_sent: volume.Sent
    weight_sent: volume.Sent
    kernel_ops: Dict[str, float]


def _traffic(config, cluster, workload, kernels, layouts, buckets) -> _Traffic:
    """Link bytes of every DP group (concurrent) and bucket (one after another), and the
    calls, bytes and kernels of a rank of the busiest stage."""
    impl = workload.implementation
    grad = [volume.Links.empty(), volume.Links.empty()]  # per hop (exact: one phase)
    weight = volume.Links.empty()
    weight_phases = [volume.Links.empty(), volume.Links.empty()]
    phases, pipelined, gather_phases = 0, 1, 0
    per_stage = {}
    for stage, layout in layouts:
        group = [volume.Links.empty() for _ in range(5)]  # grad hops, weights, weight hops
        for numel in buckets[stage]:
            shard = numel // layout.dp_size
            rs = volume.reduce_scatter_links(shard, GRAD_ELEMENT_SIZE, layout, config,
                                             workload.exact_reduce_scatter, impl)
            for i, (_, links) in enumerate(rs.phases):
                group[i].merge(links, concurrent=False)
            phases, pipelined = max(phases, len(rs.phases)), max(pipelined, rs.pipelined)
            gather = volume.all_gather_links(shard, workload.param_element_size, layout,
                                             config, impl).phases
            gather_phases = max(gather_phases, len(gather))
            for i, (_, links) in enumerate(gather):
                group[2].merge(links, concurrent=False)
                group[3 + i].merge(links, concurrent=False)
        for total, links in zip(grad + [weight] + weight_phases, group):
            total.merge(links)
        if stage not in per_stage:  # every DP group of a stage is alike: take its first
            per_stage[stage] = _rank_work(config, layout, buckets[stage], workload, kernels)
    # The busiest stage sets the pace (its DP traffic is the largest).
    stage = max(per_stage, key=lambda s: per_stage[s][0].exact_intra + per_stage[s][0].exact_inter)
    grad_sent, weight_sent, grad_calls, weight_calls, ops = per_stage[stage]
    return _Traffic(grad[:phases], weight, weight_phases[:gather_phases], pipelined, grad_calls,
                    weight_calls, grad_sent, weight_sent, ops)


def _rank_work(config, layout, stage_buckets, workload, kernels):
    """(grad sent, weight sent, grad calls, weight calls, kernel seconds) of a stage's rank."""
    impl, rank, p = workload.implementation, layout.ranks[0], layout.dp_size
    g = w = volume.Sent()
    gc = wc = Calls()
    ops: Dict[str, float] = {}
    for numel in stage_buckets:
        shard = numel // p
        g = g + volume.reduce_scatter_sent(shard, GRAD_ELEMENT_SIZE, layout, rank, config, impl)
        w = w + volume.all_gather_sent(shard, workload.param_element_size, layout, rank, config,
                                       impl)
        gc = gc + calls.reduce_scatter_calls(shard, layout, config,
                                             workload.exact_reduce_scatter, impl)
        wc = wc + calls.all_gather_calls(shard, layout, config, impl)
        for op, elements in _kernel_ops(shard, layout, config, impl).items():
            ops[op] = ops.get(op, 0.0) + kernels.seconds(op, elements)
    return g, w, gc, wc, ops


def _variant(name, label, config, cluster, workload, kernels, layouts, buckets,
             fixed) -> VariantEstimate:
    compute_s, tp_s, embedding_s, microbatches = fixed
    net = cluster.network
    t = _traffic(config, cluster, workload, kernels, layouts, buckets)
    grad_lat = cluster.latency.seconds(t.grad_calls)
    weight_lat = cluster.latency.seconds(t.weight_calls)
    grad_s = _collective_seconds(t.grad_phases, t.pipelined, net) + grad_lat
    weight_s = _collective_seconds([t.weight], 1, net) + weight_lat
    grad_exposed, weight_exposed, kernel_s = overlap.exposed(
        workload, config, kernels, buckets, layouts, net, compute_s / microbatches,
        overlap.Traffic(t.grad_phases, t.weight_phases, grad_s, weight_s, grad_lat, weight_lat,
                        t.kernel_ops))
    memory = max((_stage_memory(stage, layout, buckets[stage], config, cluster, workload)
                  for stage, layout in layouts), key=lambda m: m.per_param(m.total_bytes))
    all_links = volume.Links.empty()
    for links in t.grad_phases + [t.weight]:
        all_links.merge(links)
    return VariantEstimate(
        name=name, label=label, config=config, sent=t.grad_sent + t.weight_sent,
        grad_sent=t.grad_sent, weight_sent=t.weight_sent,
        node_inter_bytes=all_links.max_node_inter, gpu_intra_bytes=all_links.max_gpu_intra,
        grad_comm_s=grad_s, weight_comm_s=weight_s, grad_latency_s=grad_lat,
        weight_latency_s=weight_lat, grad_exposed_s=grad_exposed,
        weight_exposed_s=weight_exposed, kernel_s=kernel_s,
        compute_s=compute_s, tp_comm_s=tp_s, embedding_s=embedding_s,
        kernel_ops=t.kernel_ops, memory=memory)


def _stage_memory(stage, layout, stage_buckets, config, cluster, workload) -> LayerMemory:
    """What the layer adds on a GPU of this stage's DP group (comm/memory_plan.py)."""
    params = stage_params(workload.shape, cluster.tp, cluster.pp, stage).numel
    if not volume.two_level_gather(layout, config, workload.implementation):
        config = replace(config, weight_gather="flat")  # as the byte count gathers: no reordered copy
    return layer_memory(stage_buckets, layout.dp_size, config, params=params,
                        node_members=len(layout.nodes[0]) if layout.is_two_level else 0,
                        fp32_params=workload.param_element_size == 4,
                        whole_bucket_elements=workload.implementation.whole_bucket_elements)
