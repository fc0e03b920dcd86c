"""Text and JSON forms of an ``Estimate``."""
from __future__ import annotations

from megatron_sdp4bit.estimate.kernels import OPS
from megatron_sdp4bit.estimate.gpt_shape import total_params
from megatron_sdp4bit.estimate.timing import Estimate
from megatron_sdp4bit.estimate.volume import EXACT_REDUCE_SCATTERS

OVERLAP_TEXT = {
    "none": "none: compute + quantization kernels + reduce-scatter + all-gather, one after another",
    "grads": "grads: each bucket's reduce-scatter hidden under the backward pass that follows it "
             "(2/3 of compute); all-gather exposed",
    "full": "full: reduce-scatter under the backward pass (2/3 of compute), all-gather under the "
            "next forward pass (1/3)",
}

RUNNER_TEXT = {
    "stream": "the layer's runner: a side stream (every stage of a bucket's quantized collective "
              "issued when megatron starts it; its kernels and transfers one chain beside the "
              "pass)",
    "deferred": "the layer's runner: one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, which "
                "megatron asks for with --tp > 1 before Blackwell; --runner stream for a job "
                "without it): stages issued at megatron's later calls, each hop beside one "
                "bucket's pass; buckets of up to 64 M elements in one chunk; the quantization "
                "kernels in the step",
}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.3f}"


def format_report(e: Estimate) -> str:
    c, w, s = e.cluster, e.workload, e.workload.shape
    params = total_params(s)
    lines = [
        f"model: {s.name}: {s.num_layers} layers x {s.hidden_size} (FFN {s.ffn_hidden_size}, "
        f"{s.num_attention_heads} heads), vocab {s.vocab_size} padded to {s.padded_vocab(c.tp)}, "
        f"{params / 1e9:.3f} B parameters, seq {s.seq_length}",
        f"batch: global {w.global_batch} sequences = {w.global_batch * s.seq_length:,} tokens per "
        f"step; micro-batch {w.micro_batch}, {e.microbatches} micro-batch(es) per DP rank",
        f"cluster: {c.nodes} nodes x {c.gpus_per_node} GPUs = {c.world}; TP {c.tp}, PP {c.pp}, "
        f"DP {c.dp}; {e.layout_note}",
        f"links (each direction): intra-node {c.intra_gbps:g} Gbit/s per GPU, inter-node "
        f"{c.inter_gbps:g} Gbit/s per node"
        + (f" ({c.stream_gbps:g} for one stream: one ring, or one GPU's all-to-all sends)"
           if c.stream_gbps is not None else "")
        + f"; latency {c.latency.call_us:g} us per call, {c.latency.intra_us:g} / "
        f"{c.latency.inter_us:g} us per ring step inside / across nodes, "
        f"{c.latency.message_us:g} us per message posted to the network",
        f"collectives modelled: {w.implementation.name} ({w.implementation.messages_per_peer} "
        f"message(s) per peer per hop, staging copy {'on' if w.implementation.staging_copy else 'off'})",
        f"compute: {e.compute_s:.4g} s per step ({e.compute_source}; FLOPs = 6 x N x tokens"
        + (" + attention 12 x layers x seq x hidden x tokens" if w.attention_flops else "") + ")",
        "buckets per DP rank: " + "; ".join(
            f"stage {stage}: {len(b)} of {', '.join(f'{n:,}' for n in b[:4])}"
            + (" ..." if len(b) > 4 else "") + " elements" for stage, b in e.buckets.items()),
        f"exact reduce-scatter modelled as: {EXACT_REDUCE_SCATTERS[w.exact_reduce_scatter]}; "
        "all-gathers as rings (" + ("the quantized ones in two, across nodes then inside the "
        "node, on two-level layouts" if w.implementation.two_level_weight_gather else "one over "
        "the DP group") + "); quantized hops as direct sends",
        f"overlap: {OVERLAP_TEXT[w.overlap]}"
        + ("" if _runner(w) is None else f"; {RUNNER_TEXT[w.runner]}"
           + ("; the weight gathers issued after the optimizer step"
              if w.overlap == "full" and w.runner == "stream" else "")),
        *([f"one hardware queue: {e.one_queue_chunked_buckets} bucket(s) above 64 M elements, "
           "which the runner keeps in chunks that wait for one another inside one call, the "
           "pass held up meanwhile (docs/collectives.md, 'Chunks under one queue')"]
          if e.one_queue_chunked_buckets else []),
        f"kernels: {e.kernels.describe()}",
        "",
        "Bytes per step. sent/rank: what one rank sends (the wire accounting of "
        "megatron_sdp4bit.comm, MiB); node link: what the busiest node sends over its network "
        "link, GB, one direction.",
        "",
        "| variant | sent/rank intra MiB | sent/rank inter MiB | vs exact collectives "
        "| node link GB | GPU intra GB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v in e.variants.values():
        exact = v.sent.exact_intra + v.sent.exact_inter
        ratio = ("-" if not v.sent.total else "1.00x" if v.name == "baseline"
                 else f"{exact / v.sent.total:.2f}x less")
        lines.append(f"| {v.label} | {_mib(v.sent.intra)} | {_mib(v.sent.inter)} | {ratio} "
                     f"| {_gb(v.node_inter_bytes)} | {_gb(v.gpu_intra_bytes)} |")
    lines += _step_table(e)
    lines += [
        "",
        "Memory the layer adds per GPU (the stage with the most per parameter; comm/memory_plan.py): "
        "held = fp32 main shards kept across steps, buffers = the collectives' send and "
        "receive buffers, reused from step to step, scratch = what a collective allocates "
        "while it runs (an upper bound).",
        "",
        "| variant | held B/param | buffers B/param | scratch B/param | total B/param "
        "| held MiB | buffers MiB | scratch MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in e.variants.values():
        m = v.memory
        lines.append(f"| {v.label} | {m.per_param(m.held_bytes):.2f} | {m.per_param(m.buffer_bytes):.2f} "
                     f"| {m.per_param(m.scratch_bytes):.2f} | {m.per_param(m.total_bytes):.2f} "
                     f"| {_mib(m.held_bytes)} | {_mib(m.buffer_bytes)} | {_mib(m.scratch_bytes)} |")
    kernel_lines = []
    for v in e.variants.values():
        for op, sec in v.kernel_ops.items():
            row, _, note = OPS[op]
            kernel_lines.append(f"  {v.name}: {op} = {sec * 1e3:.2f} ms (table row "
                                f"'{row}'{'; ' + note if note else ''})")
    if kernel_lines:
        lines += ["", "kernel costs per step (one rank):"] + kernel_lines
    return "\n".join(lines)


def _step_table(e: Estimate) -> list:
    base = e.variants["baseline"]
    lines = [
        "",
        "Step time, seconds. comm = time of the collectives on the links, latency included "
        "(in brackets: what the step waits for after overlap); TP = tensor-parallel "
        "all-reduces; emb = the tied embeddings' gradient all-reduce (PP > 1).",
        "",
        "| variant | compute | TP | kernels | grad comm (exposed) | weight comm (exposed) "
        "| of which latency | emb | step | TFLOP/s/GPU | speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in e.variants.items():
        lines.append(
            f"| {v.label} | {v.compute_s:.4f} | {v.tp_comm_s:.4f} | {v.kernel_s:.4f} "
            f"| {v.grad_comm_s:.4f} ({v.grad_exposed_s:.4f}) | {v.weight_comm_s:.4f} "
            f"({v.weight_exposed_s:.4f}) | {v.grad_latency_s + v.weight_latency_s:.4f} "
            f"| {v.embedding_s:.4f} | {v.step_s:.4f} | {e.tflops_per_gpu(name):.1f} "
            f"| {base.step_s / v.step_s:.2f}x |")
    return lines


def _runner(w) -> "str | None":
    """The layer's runner the estimate prices, or None: no overlap (no runner), or the
    paper's code (not this layer's)."""
    if w.overlap == "none" or w.implementation.max_chunk_elements is None:
        return None
    return w.runner


def to_json(e: Estimate) -> dict:
    c, w = e.cluster, e.workload
    return {
        "model": w.shape.name, "parameters": total_params(w.shape),
        "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "tp": c.tp, "pp": c.pp, "dp": c.dp,
        "intra_gbps": c.intra_gbps, "inter_gbps": c.inter_gbps, "stream_gbps": c.stream_gbps,
        "latency_us": {"call": c.latency.call_us, "intra": c.latency.intra_us,
                       "inter": c.latency.inter_us, "message": c.latency.message_us},
        "implementation": w.implementation.name,
        "global_batch": w.global_batch, "flops_per_step": e.flops, "compute_s": e.compute_s,
        "overlap": w.overlap, "runner": _runner(w),
        "one_queue_chunked_buckets": e.one_queue_chunked_buckets,
        "exact_reduce_scatter": w.exact_reduce_scatter,
        "kernels": e.kernels.describe(), "buckets": {str(k): v for k, v in e.buckets.items()},
        "variants": {
            name: {
                "label": v.label,
                "sent_intra_bytes": v.sent.intra, "sent_inter_bytes": v.sent.inter,
                "exact_intra_bytes": v.sent.exact_intra, "exact_inter_bytes": v.sent.exact_inter,
                "grad_sent_bytes": v.grad_sent.total, "weight_sent_bytes": v.weight_sent.total,
                "node_inter_bytes": v.node_inter_bytes, "gpu_intra_bytes": v.gpu_intra_bytes,
                "grad_comm_s": v.grad_comm_s, "weight_comm_s": v.weight_comm_s,
                "grad_exposed_s": v.grad_exposed_s, "weight_exposed_s": v.weight_exposed_s,
                "grad_latency_s": v.grad_latency_s, "weight_latency_s": v.weight_latency_s,
                "tp_comm_s": v.tp_comm_s, "embedding_s": v.embedding_s,
                "kernel_s": v.kernel_s, "kernel_ops_s": v.kernel_ops, "step_s": v.step_s,
                "tflops_per_gpu": e.tflops_per_gpu(name), "speedup": e.speedup(name),
                "memory_params": v.memory.params, "memory_held_bytes": v.memory.held_bytes,
                "memory_buffer_bytes": v.memory.buffer_bytes,
                "memory_scratch_bytes": v.memory.scratch_bytes,
            } for name, v in e.variants.items()
        },
    }
