"""``--check-paper``: the SDP4Bit paper's Table 2 predicted with one set of constants per cluster.

Table 2 (16 nodes; TFLOP/s per GPU of Megatron-LM's FLOP count, exact
collectives vs SDP4Bit) ran the reference fork's speed scripts
(``sample_scripts/speed/Exp1/*.sh`` of its Megatron-LM branch, linked from the
SDP4Bit README): micro-batch 1, no gradient accumulation (global batch = DP),
sequence 2048, no overlap of the data-parallel collectives, selective
recomputation, the parallel layouts of its README (``LAYOUTS``) and
``--gradient-alltoall-pipeline 8`` for 1.3B-6.7B, none (1) for 13B and 18B.
The SDP4Bit rows are modelled as that code runs (``implementation.PAPER_REFERENCE``).

Two cluster constants are derived, not read (``clusters.py`` says which):
``table4_rates`` (the A100 cluster's network, from the paper's Table 4) and
``calibrate`` (the H800 cluster's compute and network, from two of its own
baselines, which makes those two rows calibration points).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from megatron_sdp4bit.estimate.clusters import CLUSTER_TYPES, ClusterType
from megatron_sdp4bit.estimate.implementation import PAPER_REFERENCE, Implementation
from megatron_sdp4bit.estimate.kernels import KernelModel
from megatron_sdp4bit.estimate.gpt_shape import GPT2_BPE_VOCAB_SIZE, ModelShape
from megatron_sdp4bit.estimate.timing import Cluster, Estimate, Workload, estimate

NODES = 16
TOLERANCE = 0.20  # the bound on every published number
SEQ = 2048

#: name: (layers, hidden, heads, --gradient-alltoall-pipeline of its SDP4Bit script)
PAPER_MODELS: Dict[str, Tuple[int, int, int, int]] = {
    "1.3B": (24, 2048, 16, 8), "2.7B": (32, 2560, 32, 8), "6.7B": (32, 4096, 32, 8),
    "13B": (40, 5120, 40, 1), "18B": (40, 6144, 48, 1),
}
#: (cluster type, model): (TP, PP), the README's table (TP never beyond a node).
LAYOUTS: Dict[Tuple[str, str], Tuple[int, int]] = {
    **{(c, m): (1, 1) for c in CLUSTER_TYPES for m in ("1.3B", "2.7B")},
    **{(c, "6.7B"): (4, 1) for c in CLUSTER_TYPES},
    **{("a100-slingshot", m): (4, 2) for m in ("13B", "18B")},
    **{("h800-ib", m): (8, 1) for m in ("13B", "18B")},
}
#: (cluster type, model): published TFLOP/s per GPU, (exact collectives, SDP4Bit).
TABLE2: Dict[Tuple[str, str], Tuple[float, float]] = {
    ("a100-slingshot", "1.3B"): (24.1, 57.6), ("a100-slingshot", "2.7B"): (24.0, 58.4),
    ("a100-slingshot", "6.7B"): (10.8, 37.1), ("a100-slingshot", "13B"): (9.7, 26.0),
    ("a100-slingshot", "18B"): (10.2, 29.8),
    ("h800-ib", "1.3B"): (69.1, 106.0), ("h800-ib", "2.7B"): (71.9, 116.9),
    ("h800-ib", "6.7B"): (26.2, 77.9), ("h800-ib", "13B"): (13.9, 53.5),
    ("h800-ib", "18B"): (14.5, 59.2),
}
#: The paper's Table 4 (1.3B on 32 A100s = 8 nodes of 4): gradient communication per step.
TABLE4_NODES, TABLE4_EXACT_S, TABLE4_SDP4BIT_S = 8, 0.3793, 0.0458
#: The two H800 baselines its compute rate and network are calibrated on.
H800_CALIBRATION_ROWS = ("1.3B", "18B")


def paper_shape(model: str) -> ModelShape:
    layers, hidden, heads, _ = PAPER_MODELS[model]
    return ModelShape(model, layers, hidden, heads, 4 * hidden, SEQ, SEQ, GPT2_BPE_VOCAB_SIZE,
                      False, 1, None)


def cluster_of(ctype: ClusterType, nodes: int, tp: int, pp: int) -> Cluster:
    return Cluster(nodes, ctype.gpus_per_node, tp, pp, ctype.intra_gbps, ctype.inter_gbps,
                   ctype.stream_gbps, ctype.latency)


def paper_estimate(ctype: ClusterType, model: str, impl: Implementation = PAPER_REFERENCE,
                   nodes: int = NODES, kernels: Optional[KernelModel] = None) -> Estimate:
    """One row of Table 2 (or the same model at another node count) on ``ctype``; kernels
    at the cluster type's rates unless ``kernels`` is given (``--kernel-rates``)."""
    tp, pp = LAYOUTS[(ctype.name, model)]
    cluster = cluster_of(ctype, nodes, tp, pp)
    workload = Workload(shape=paper_shape(model), global_batch=cluster.dp, micro_batch=1,
                        tflops=ctype.tflops, attention_flops=True,
                        pipeline_chunks=PAPER_MODELS[model][3], implementation=impl)
    return estimate(cluster, workload, kernels or KernelModel("gpu", scale=ctype.kernel_scale),
                    ["baseline", "sdp4bit"])


@dataclass(frozen=True)
class CheckRow:
    cluster: str
    model: str
    layout: Tuple[int, int, int]         # TP, PP, DP
    published: Tuple[float, float]       # TFLOP/s per GPU: exact, SDP4Bit
    predicted: Tuple[float, float]
    calibration: bool                    # a row the cluster's constants were calibrated on

    @staticmethod
    def _speedup(pair: Tuple[float, float]) -> float:
        return pair[1] / pair[0]

    @property
    def errors(self) -> Tuple[float, float, float]:
        """Predicted / published - 1 of the exact TFLOP/s, SDP4Bit's and the speedup."""
        return (self.predicted[0] / self.published[0] - 1, self.predicted[1] / self.published[1] - 1,
                self._speedup(self.predicted) / self._speedup(self.published) - 1)

    @property
    def within(self) -> bool:
        return all(abs(e) <= TOLERANCE for e in self.errors)


def check_paper(types: Dict[str, ClusterType], kernels: Optional[KernelModel] = None,
                impl: Implementation = PAPER_REFERENCE) -> List[CheckRow]:
    """Every row of Table 2, predicted with these cluster types' constants."""
    rows = []
    for (name, model), published in TABLE2.items():
        e = paper_estimate(types[name], model, impl, kernels=kernels)
        rows.append(CheckRow(name, model, (*LAYOUTS[(name, model)], e.cluster.dp), published,
                             (e.tflops_per_gpu("baseline"), e.tflops_per_gpu("sdp4bit")),
                             name == "h800-ib" and model in H800_CALIBRATION_ROWS))
    return rows


def format_check(rows: List[CheckRow]) -> str:
    lines = ["| cluster | model | TP x PP, DP | exact TFLOP/s: paper -> predicted | SDP4Bit "
             "TFLOP/s: paper -> predicted | speedup: paper -> predicted |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        e = r.errors
        mark = " (calibration)" if r.calibration else ""
        lines.append(
            f"| {r.cluster} | {r.model} | {r.layout[0]} x {r.layout[1]}, {r.layout[2]} "
            f"| {r.published[0]:.1f} -> {r.predicted[0]:.1f} ({e[0]:+.0%}){mark} "
            f"| {r.published[1]:.1f} -> {r.predicted[1]:.1f} ({e[1]:+.0%}) "
            f"| {r.published[1] / r.published[0]:.2f}x -> {r.predicted[1] / r.predicted[0]:.2f}x "
            f"({e[2]:+.0%}) |")
    return "\n".join(lines)


# --- derived constants ---------------------------------------------------------------

def _solve(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] (log scale, to 1 part in 10^4) where the monotonic ``f(x)`` equals
    ``target``."""
    rising = f(hi) > f(lo)
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        if (f(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def _table4_seconds(ctype: ClusterType) -> Tuple[float, float]:
    """(exact, SDP4Bit) gradient communication of Table 4's setting on ``ctype`` (SDP4Bit's
    with its gradient kernels, which the paper's timer includes)."""
    e = paper_estimate(ctype, "1.3B", nodes=TABLE4_NODES)
    base, sdp = e.variants["baseline"], e.variants["sdp4bit"]
    kernels = sum(s for op, s in sdp.kernel_ops.items() if op.startswith("grad_"))
    return base.grad_comm_s, sdp.grad_comm_s + kernels


def table4_rates(ctype: ClusterType) -> Tuple[float, float]:
    """(stream, inter) Gbit/s per node at which the model reproduces Table 4: one ring's
    rate from the exact reduce-scatter's time, then the node's rate from SDP4Bit's
    (its inter-node hop sends from every GPU: several streams)."""
    def with_rates(stream, inter):
        return dataclasses.replace(ctype, stream_gbps=stream, inter_gbps=inter)
    stream = _solve(lambda g: _table4_seconds(with_rates(g, 1e6))[0], TABLE4_EXACT_S, 1.0, 1e5)
    inter = _solve(lambda g: _table4_seconds(with_rates(stream, g))[1], TABLE4_SDP4BIT_S,
                   stream, 1e5)
    return stream, inter


def calibrate(ctype: ClusterType) -> Tuple[float, float]:
    """(TFLOP/s, inter Gbit/s) at which the model reproduces the two calibration baselines
    of Table 2 (a compute-heavy TP 1 row and a network-heavy TP 8 row)."""
    compute_row, network_row = H800_CALIBRATION_ROWS

    def base(ct, model):
        return paper_estimate(ct, model).tflops_per_gpu("baseline")

    def inter_for(tflops):
        ct = dataclasses.replace(ctype, tflops=tflops)
        return _solve(lambda g: base(dataclasses.replace(ct, inter_gbps=g), network_row),
                      TABLE2[(ctype.name, network_row)][0], 10.0, 1e5)

    tflops = _solve(lambda r: base(dataclasses.replace(ctype, tflops=r, inter_gbps=inter_for(r)),
                                   compute_row), TABLE2[(ctype.name, compute_row)][0], 10.0, 2000.0)
    return tflops, inter_for(tflops)


# --- where SDP4Bit stops paying ------------------------------------------------------

BREAK_EVEN_SPEEDUP = 1.1
BREAK_EVEN_RANGE = (0.01, 100.0)  # x the cluster type's network rates


def break_even_gbps(ctype: ClusterType, model: str, impl: Implementation,
                    kernels: Optional[KernelModel] = None,
                    speedup: float = BREAK_EVEN_SPEEDUP) -> Optional[float]:
    """The inter-node rate per node (the stream rate scaled alike) above which SDP4Bit's
    predicted speedup falls under ``speedup``; None when it is under it at the low end of
    ``BREAK_EVEN_RANGE`` already, inf when still above it at the high end."""
    def at(factor):
        stream = None if ctype.stream_gbps is None else ctype.stream_gbps * factor
        ct = dataclasses.replace(ctype, inter_gbps=ctype.inter_gbps * factor, stream_gbps=stream)
        return paper_estimate(ct, model, impl, kernels=kernels).speedup("sdp4bit")
    low, high = BREAK_EVEN_RANGE
    if at(low) < speedup:
        return None
    if at(high) >= speedup:
        return math.inf
    return ctype.inter_gbps * _solve(at, speedup, low, high)


def format_break_even(types: Dict[str, ClusterType], kernels: Optional[KernelModel] = None) -> str:
    """Per cluster type and model: where the predicted speedup falls under 1.1x, with the
    paper's reference code and with megatron_sdp4bit's collectives."""
    from megatron_sdp4bit.estimate.implementation import THIS_PROJECT

    def cell(gbps):
        if gbps is None:
            return f"never {BREAK_EVEN_SPEEDUP:g}x"
        return (f"none up to {BREAK_EVEN_RANGE[1]:g}x" if math.isinf(gbps) else f"{gbps:,.0f}")
    lines = [f"Inter-node Gbit/s per node above which SDP4Bit's speedup falls under "
             f"{BREAK_EVEN_SPEEDUP:g}x (Table 2's layouts, 16 nodes, everything else as the "
             "cluster type):", "",
             "| cluster | model | cluster's rate | speedup at it: reference / megatron_sdp4bit "
             "| break-even: reference code | break-even: megatron_sdp4bit |", "|---|---|---:|---|---:|---:|"]
    for (name, model) in TABLE2:
        ct = types[name]
        at_rate = [paper_estimate(ct, model, impl, kernels=kernels).speedup("sdp4bit")
                   for impl in (PAPER_REFERENCE, THIS_PROJECT)]
        lines.append(f"| {name} | {model} | {ct.inter_gbps:g} | {at_rate[0]:.2f}x / {at_rate[1]:.2f}x "
                     f"| {cell(break_even_gbps(ct, model, PAPER_REFERENCE, kernels))} "
                     f"| {cell(break_even_gbps(ct, model, THIS_PROJECT, kernels))} |")
    return "\n".join(lines)
