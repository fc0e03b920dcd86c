"""``sdp4bit-estimate``: predicted step time and DP bytes of baseline, ZeRO++ and SDP4Bit.

    python -m megatron_sdp4bit.estimate --config configs/gpt_6.7b.yaml --nodes 16 \\
        --gpus-per-node 8 --tp 1 --pp 1 --intra-gbps 1600 --inter-gbps 400 --tflops 300
    python -m megatron_sdp4bit.estimate --config configs/gpt_1.3b.yaml --nodes 16 \\
        --cluster-type h800-ib --kernel-rates bench_quant.json
    python -m megatron_sdp4bit.estimate --check-paper      # the paper's Table 2, exit 1 if off
    python -m megatron_sdp4bit.estimate --break-even       # link rate where SDP4Bit stops paying

Bad input exits with status 2 and one line that names the flag.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from megatron_sdp4bit.estimate.clusters import CLUSTER_TYPES
from megatron_sdp4bit.estimate.kernels import (CPU_TABLE_THREADS, KernelModel, KernelRatesError,
                                               MeasuredRates)

# volume.EXACT_REDUCE_SCATTERS' keys (volume imports torch; the flags are checked before that)
EXACT_REDUCE_SCATTERS = ("ring", "alltoall", "allreduce")
VARIANT_NAMES = ("baseline", "zeropp", "sdp4bit")  # timing.VARIANTS' keys
IMPLEMENTATIONS = ("megatron_sdp4bit", "paper-reference")  # implementation.py's two
RUNNERS = ("stream", "deferred")  # timing.RUNNERS
# Flags that describe one run; --check-paper and --break-even take none of them.
RUN_FLAGS = ("config", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
             "seq_length", "vocab_size", "micro_batch_size", "global_batch_size",
             "untie_embeddings", "nodes", "gpus_per_node", "tp", "pp", "dp", "compute_s",
             "cluster_type", "bucket_size", "pipeline_chunks", "json")
# Cluster constants: they override both cluster types' under --check-paper / --break-even.
CONSTANT_FLAGS = {"intra_gbps": "intra_gbps", "inter_gbps": "inter_gbps",
                  "stream_gbps": "stream_gbps", "tflops": "tflops"}

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
    c.add_argument("--cluster-type", choices=tuple(CLUSTER_TYPES), default=None,
                   help="take the constants of one of the paper's clusters (clusters.py, with "
                   "their sources) as defaults of the cluster, network, compute and kernel flags")
    c.add_argument("--nodes", type=pos_int, default=None, help="(required)")
    c.add_argument("--gpus-per-node", type=pos_int, default=None,
                   help="(required unless --cluster-type)")
    for flag, kind in (("--tp", "tensor"), ("--pp", "pipeline")):
        c.add_argument(flag, type=pos_int, default=None,
                       help=f"{kind}-parallel size (default: the config's, else 1)")
    c.add_argument("--dp", type=pos_int, default=None,
                   help="data-parallel size; must equal nodes x GPUs per node / (TP x PP)")
    n = p.add_argument_group("network")
    n.add_argument("--intra-gbps", type=pos_float, default=None,
                   help="Gbit/s each GPU sends inside its node (each direction)")
    n.add_argument("--inter-gbps", type=pos_float, default=None,
                   help="Gbit/s each node sends to other nodes, all its NICs together (each "
                   "direction)")
    n.add_argument("--stream-gbps", type=pos_float, default=None,
                   help="Gbit/s one ring (one DP group), or one GPU's share of an all-to-all, "
                   "reaches per node on its own (default: all of --inter-gbps)")
    n.add_argument("--latency-us", default=None, metavar="CALL,INTRA,INTER,MESSAGE",
                   help="microseconds per collective call, per ring step (or all-to-all "
                   "traversal) inside a node and across nodes, per message posted to the "
                   "network (default: NCCL's tuning model, 8.4,3.4,14.0,3.0)")
    t = p.add_argument_group("compute (one of; --tflops defaults to --cluster-type's)")
    g = t.add_mutually_exclusive_group()
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
    s.add_argument("--runner", choices=("auto",) + RUNNERS, default="auto",
                   help="with --overlap: the layer's runner on NCCL, stream (a side stream) or "
                   "deferred (one hardware queue, CUDA_DEVICE_MAX_CONNECTIONS=1); auto: "
                   "deferred with --tp > 1 (megatron asks for that variable under tensor "
                   "parallelism before Blackwell, and its example scripts set it always), "
                   "else stream; with --implementation paper-reference: stream")
    s.add_argument("--implementation", choices=IMPLEMENTATIONS, default=None,
                   help="whose quantized collectives: megatron_sdp4bit (default) or the paper's "
                   "reference code (default of --check-paper): calls, messages, staging copy")
    k = p.add_argument_group("quantization kernels")
    k.add_argument("--kernels", choices=("gpu", "cpu"), default="gpu",
                   help="gpu: assumed rates (the paper's A100 figure); cpu: the measured CPU table")
    k.add_argument("--kernel-rates", default=None, metavar="FILE",
                   help="measured rates: the JSON of scripts/bench_quant.py --json (or "
                   "scripts/gpu_check.sh's bench_quant.json) from your device")
    k.add_argument("--kernel-gbps", type=pos_float, default=None,
                   help="gpu: one rate for every op, GB/s of fp32 input")
    k.add_argument("--cpu-cores-per-rank", type=pos_float, default=float(CPU_TABLE_THREADS),
                   help=f"cpu: cores each rank has (the table used {CPU_TABLE_THREADS})")
    _add_output_flags(p.add_argument_group("output"))
    return p


def _add_output_flags(o) -> None:
    o.add_argument("--variants", default="baseline,zeropp,sdp4bit",
                   help="comma-separated: baseline, zeropp, sdp4bit (baseline always included)")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    o.add_argument("--check-paper", action="store_true",
                   help="predict the paper's Table 2 (both clusters, five models) with the "
                   "constants of clusters.py; exit 1 when a number is off by more than 20%%")
    o.add_argument("--break-even", action="store_true",
                   help="per cluster type and model: the inter-node rate above which SDP4Bit's "
                   "predicted speedup falls under 1.1x")


def _fail(flag: str, message: str) -> int:
    text = message if message.startswith(flag) else f"{flag}: {message}"
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return 2


class _FlagError(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def _latency(text: Optional[str]):
    """``--latency-us CALL,INTRA,INTER,MESSAGE`` as a ``network.Latency`` (None: not given)."""
    from megatron_sdp4bit.estimate.network import Latency

    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 4 or any(not v >= 0 or v == float("inf") for v in values):
        raise _FlagError("--latency-us", f"expected four numbers >= 0 (microseconds per call, "
                         f"intra step, inter step, message), e.g. 8.4,3.4,14.0,3.0; got {text!r}")
    return Latency(*values)


def _kernel_model(args, cluster_type) -> KernelModel:
    if args.kernel_rates is not None:
        for flag, value in (("--kernel-gbps", args.kernel_gbps),
                            ("--kernels", args.kernels if args.kernels != "gpu" else None)):
            if value is not None:
                raise _FlagError(flag, "not with --kernel-rates (the file gives every rate)")
        try:
            return KernelModel("measured", measured=MeasuredRates.from_bench_json(args.kernel_rates))
        except KernelRatesError as exc:
            raise _FlagError("--kernel-rates", str(exc)) from None
    if args.kernel_gbps is not None and args.kernels != "gpu":
        raise _FlagError("--kernel-gbps", "only applies to --kernels gpu")
    if args.cpu_cores_per_rank != CPU_TABLE_THREADS and args.kernels != "cpu":
        raise _FlagError("--cpu-cores-per-rank", "only applies to --kernels cpu")
    scale = cluster_type.kernel_scale if cluster_type and args.kernels == "gpu" else 1.0
    return KernelModel(args.kernels, args.kernel_gbps, args.cpu_cores_per_rank, scale=scale)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.check_paper or args.break_even:
            return _run_paper(parser, args)
        return _run_estimate(args)
    except _FlagError as exc:
        return _fail(exc.flag, str(exc))


def _run_paper(parser, args) -> int:
    """--check-paper / --break-even: the paper's two clusters, the constant flags overriding."""
    allowed = {"check_paper", "break_even", "latency_us", "kernel_rates", "implementation",
               *CONSTANT_FLAGS}
    given = [k for k, v in vars(args).items() if v != parser.get_default(k) and k not in allowed]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise _FlagError(flag, "not with --check-paper / --break-even, which run the paper's "
                         "own settings (only the cluster constants, --latency-us, "
                         "--kernel-rates and --implementation apply)")
    import dataclasses

    from megatron_sdp4bit.estimate import implementation, paper
    from megatron_sdp4bit.estimate.clusters import CLUSTER_TYPES as TYPES

    changes = {field: getattr(args, dest) for dest, field in CONSTANT_FLAGS.items()
               if getattr(args, dest) is not None}
    latency = _latency(args.latency_us)
    if latency is not None:
        changes["latency"] = latency
    types = {name: dataclasses.replace(t, **changes) for name, t in TYPES.items()}
    kernels = _kernel_model(args, None) if args.kernel_rates else None
    impl = (implementation.THIS_PROJECT if args.implementation == "megatron_sdp4bit"
            else implementation.PAPER_REFERENCE)
    status = 0
    if args.check_paper:
        rows = paper.check_paper(types, kernels, impl)
        print(paper.format_check(rows))
        off = [r for r in rows if not r.within]
        print(f"\n{len(rows) - len(off)} of {len(rows)} rows within {paper.TOLERANCE:.0%} on all "
              f"three numbers ({impl.name}; constants: megatron_sdp4bit/estimate/clusters.py)"
              + (f"; off: {', '.join(f'{r.cluster} {r.model}' for r in off)}" if off else ""))
        status = 1 if off else 0
    if args.break_even:
        print(("\n" if args.check_paper else "") + paper.format_break_even(types, kernels))
    return status


def _run_estimate(args) -> int:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANT_NAMES]
    if unknown or not variants:
        return _fail("--variants", f"unknown {unknown}; choose from {', '.join(VARIANT_NAMES)}")
    variants = ["baseline"] + [v for v in variants if v != "baseline"]
    ctype = CLUSTER_TYPES[args.cluster_type] if args.cluster_type else None
    if ctype is not None:  # the cluster's constants, where no flag gives one
        defaults = {"gpus_per_node": ctype.gpus_per_node, "intra_gbps": ctype.intra_gbps,
                    "inter_gbps": ctype.inter_gbps, "stream_gbps": ctype.stream_gbps}
        if args.compute_s is None:
            defaults["tflops"] = ctype.tflops
        for dest, value in defaults.items():
            if getattr(args, dest) is None:
                setattr(args, dest, value)
    missing = [flag for flag, value in (("--nodes", args.nodes),
                                        ("--gpus-per-node", args.gpus_per_node),
                                        ("--intra-gbps", args.intra_gbps),
                                        ("--inter-gbps", args.inter_gbps)) if value is None]
    if args.tflops is None and args.compute_s is None:
        missing.append("--tflops or --compute-s")
    if missing:  # a cluster type gives all but the node count
        hint = (f"--cluster-type {args.cluster_type} gives the rest, not how many nodes" if ctype
                else "or take a cluster's with --cluster-type")
        return _fail(missing[0], "the following arguments are required: " + ", ".join(missing) + f" ({hint})")
    kernels = _kernel_model(args, ctype)
    latency = _latency(args.latency_us) or (ctype.latency if ctype else None)
    return _estimate_and_print(args, variants, kernels, latency)


def _estimate_and_print(args, variants, kernels, latency) -> int:
    from megatron_sdp4bit.estimate import implementation
    from megatron_sdp4bit.estimate.gpt_shape import ModelError, check_split, load_model_shape
    from megatron_sdp4bit.estimate.network import NCCL_LATENCY
    from megatron_sdp4bit.estimate.timing import Cluster, EstimateError, Workload, estimate

    try:
        shape = load_model_shape(args.config, args.vocab_size)
        shape = shape.with_overrides(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, untied_embeddings=args.untie_embeddings)
        tp = args.tp if args.tp is not None else shape.tensor_parallel
        pp = args.pp if args.pp is not None else shape.pipeline_parallel
        world = args.nodes * args.gpus_per_node
        if world % (tp * pp):
            return _fail("--tp", f"--tp {tp} x --pp {pp} does not divide the {world} "
                         f"GPUs (--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node})")
        dp = world // (tp * pp)
        if args.dp is not None and args.dp != dp:
            return _fail("--dp", f"--dp {args.dp} but --nodes x --gpus-per-node / (--tp x --pp) "
                         f"= {world} / {tp * pp} = {dp}")
        check_split(shape, tp, pp)
        cluster = Cluster(args.nodes, args.gpus_per_node, tp, pp, args.intra_gbps,
                          args.inter_gbps, args.stream_gbps, latency or NCCL_LATENCY)
        impl = (implementation.PAPER_REFERENCE if args.implementation == "paper-reference"
                else implementation.THIS_PROJECT)
        workload = Workload(shape=shape, global_batch=shape.global_batch_size or shape.micro_batch_size * dp,
                            micro_batch=shape.micro_batch_size, tflops=args.tflops,
                            compute_s=args.compute_s, attention_flops=args.attention_flops,
                            overlap=args.overlap, bucket_size=args.bucket_size,
                            exact_reduce_scatter=args.exact_reduce_scatter,
                            pipeline_chunks=args.pipeline_chunks,
                            param_element_size=2 if args.param_dtype == "bf16" else 4,
                            implementation=impl, runner=_runner(args.runner, tp, impl))
        result = estimate(cluster, workload, kernels, variants)
    except (ModelError, EstimateError) as exc:
        return _fail(exc.flag, str(exc))
    from megatron_sdp4bit.estimate.output import format_report, to_json

    print(json.dumps(to_json(result), indent=1) if args.json else format_report(result))
    return 0


def _runner(choice: str, tp: int, impl) -> str:
    """``--runner``: ``auto`` is the runner megatron's own check leaves the layer: one
    hardware queue under tensor parallelism (megatron asks for CUDA_DEVICE_MAX_CONNECTIONS=1
    there before Blackwell; ``megatron/background.py`` picks the runner from it), for this
    project's collectives (the paper's code has no runner)."""
    from megatron_sdp4bit.estimate import implementation

    if choice != "auto":
        return choice
    return "deferred" if tp > 1 and impl is implementation.THIS_PROJECT else "stream"


if __name__ == "__main__":
    sys.exit(main())
