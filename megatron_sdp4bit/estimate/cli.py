"""``sdp4bit-estimate``: predicted step time and DP bytes of baseline, ZeRO++ and SDP4Bit.

    python -m megatron_sdp4bit.estimate --config configs/gpt_6.7b.yaml --nodes 16 \\
        --gpus-per-node 8 --tp 1 --pp 1 --intra-gbps 1600 --inter-gbps 400 --tflops 300

Bad input exits with status 2 and one line that names the flag.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from megatron_sdp4bit.estimate.kernels import CPU_TABLE_THREADS, KernelModel

# volume.EXACT_REDUCE_SCATTERS' keys (volume imports torch; the flags are checked before that)
EXACT_REDUCE_SCATTERS = ("ring", "alltoall", "allreduce")
VARIANT_NAMES = ("baseline", "zeropp", "sdp4bit")  # timing.VARIANTS' keys

PROG = "sdp4bit-estimate"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse prints usage too)
        self.exit(2, f"{PROG}: error: {message}\n")


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'whole ' if kind is int else ''}number, "
                                             f"got {text!r}") from None
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    pos_int, pos_float = _positive(int), _positive(float)
    p = _Parser(prog=PROG, allow_abbrev=False,
                description="Predict the step time and data-parallel bytes of GPT pre-training with "
                "the exact collectives, ZeRO++ and SDP4Bit (docs/performance.md, 'Estimator').")
    m = p.add_argument_group("model (a driver config; the flags below override it)")
    m.add_argument("--config", default=None,
                   help="YAML model config, e.g. configs/gpt_6.7b.yaml (default: the driver's defaults)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
                 "--seq-length", "--vocab-size", "--micro-batch-size", "--global-batch-size"):
        m.add_argument(flag, type=pos_int, default=None)
    m.add_argument("--untie-embeddings", action="store_true", default=None)
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=pos_int, required=True)
    c.add_argument("--gpus-per-node", type=pos_int, required=True)
    c.add_argument("--tp", type=pos_int, default=None,
                   help="tensor-parallel size (default: the config's, else 1)")
    c.add_argument("--pp", type=pos_int, default=None,
                   help="pipeline-parallel size (default: the config's, else 1)")
    c.add_argument("--dp", type=pos_int, default=None,
                   help="data-parallel size; must equal nodes x GPUs per node / (TP x PP)")
    c.add_argument("--intra-gbps", type=pos_float, required=True,
                   help="Gbit/s each GPU sends inside its node (each direction)")
    c.add_argument("--inter-gbps", type=pos_float, required=True,
                   help="Gbit/s each node sends to other nodes, all its NICs together (each direction)")
    t = p.add_argument_group("compute (one of)")
    g = t.add_mutually_exclusive_group(required=True)
    g.add_argument("--tflops", type=pos_float, help="achieved TFLOP/s per GPU on the model's FLOPs")
    g.add_argument("--compute-s", type=pos_float,
                   help="measured compute seconds per step (forward + backward + optimizer)")
    t.add_argument("--attention-flops", action="store_true",
                   help="add the attention matmuls (12 x layers x seq x hidden per token) to 6 x N x tokens")
    s = p.add_argument_group("schedule and collectives")
    s.add_argument("--overlap", choices=("none", "grads", "full"), default="none",
                   help="none: communication adds to compute; grads: reduce-scatter under the backward "
                   "pass; full: also the all-gather under the forward pass")
    s.add_argument("--bucket-size", type=pos_int, default=None,
                   help="DDP bucket elements (default: megatron's, one bucket without overlap)")
    s.add_argument("--exact-reduce-scatter", choices=EXACT_REDUCE_SCATTERS, default="ring",
                   help="how the baseline's reduce-scatter moves bytes: ring (NCCL), alltoall "
                   "(comm/exact_alltoall.py), allreduce (gloo's reduce_scatter)")
    s.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="model weights, i.e. the exact all-gather's elements (gradients: fp32)")
    s.add_argument("--pipeline-chunks", type=pos_int, default=None,
                   help="quantized reduce-scatter pipeline chunks (presets: 1)")
    k = p.add_argument_group("quantization kernels")
    k.add_argument("--kernels", choices=("gpu", "cpu"), default="gpu",
                   help="gpu: assumed rates (no GPU table measured yet); cpu: the measured CPU table")
    k.add_argument("--kernel-gbps", type=pos_float, default=None,
                   help="gpu: one rate for every op, GB/s of fp32 input")
    k.add_argument("--cpu-cores-per-rank", type=pos_float, default=float(CPU_TABLE_THREADS),
                   help=f"cpu: cores each rank has (the table used {CPU_TABLE_THREADS})")
    o = p.add_argument_group("output")
    o.add_argument("--variants", default="baseline,zeropp,sdp4bit",
                   help="comma-separated: baseline, zeropp, sdp4bit (baseline always included)")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _fail(flag: str, message: str) -> int:
    text = message if message.startswith(flag) else f"{flag}: {message}"
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANT_NAMES]
    if unknown or not variants:
        return _fail("--variants", f"unknown {unknown}; choose from {', '.join(VARIANT_NAMES)}")
    variants = ["baseline"] + [v for v in variants if v != "baseline"]
    if args.kernel_gbps is not None and args.kernels != "gpu":
        return _fail("--kernel-gbps", "only applies to --kernels gpu")
    if args.cpu_cores_per_rank != CPU_TABLE_THREADS and args.kernels != "cpu":
        return _fail("--cpu-cores-per-rank", "only applies to --kernels cpu")
    from megatron_sdp4bit.estimate.model import ModelError, check_split, load_model_shape
    from megatron_sdp4bit.estimate.timing import Cluster, EstimateError, Workload, estimate

    try:
        shape = load_model_shape(args.config, args.vocab_size)
        shape = shape.with_overrides(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, untied_embeddings=args.untie_embeddings)
        if args.tp is None:
            args.tp = shape.tensor_parallel
        if args.pp is None:
            args.pp = shape.pipeline_parallel
        world = args.nodes * args.gpus_per_node
        if world % (args.tp * args.pp):
            return _fail("--tp", f"--tp {args.tp} x --pp {args.pp} does not divide the {world} "
                         f"GPUs (--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node})")
        dp = world // (args.tp * args.pp)
        if args.dp is not None and args.dp != dp:
            return _fail("--dp", f"--dp {args.dp} but --nodes x --gpus-per-node / (--tp x --pp) "
                         f"= {world} / {args.tp * args.pp} = {dp}")
        check_split(shape, args.tp, args.pp)
        cluster = Cluster(args.nodes, args.gpus_per_node, args.tp, args.pp,
                          args.intra_gbps, args.inter_gbps)
        global_batch = shape.global_batch_size or shape.micro_batch_size * dp
        workload = Workload(shape=shape, global_batch=global_batch,
                            micro_batch=shape.micro_batch_size, tflops=args.tflops,
                            compute_s=args.compute_s, attention_flops=args.attention_flops,
                            overlap=args.overlap, bucket_size=args.bucket_size,
                            exact_reduce_scatter=args.exact_reduce_scatter,
                            pipeline_chunks=args.pipeline_chunks,
                            param_element_size=2 if args.param_dtype == "bf16" else 4)
        kernels = KernelModel(args.kernels, args.kernel_gbps, args.cpu_cores_per_rank)
        result = estimate(cluster, workload, kernels, variants)
    except (ModelError, EstimateError) as exc:
        return _fail(exc.flag, str(exc))
    from megatron_sdp4bit.estimate.report import format_report, to_json

    if args.json:
        print(json.dumps(to_json(result), indent=1))
    else:
        print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
