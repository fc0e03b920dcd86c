"""The two cluster types of the SDP4Bit paper's Table 2, each constant stated once with its source.

``--cluster-type NAME`` takes these as the defaults of the cluster flags
(``--gpus-per-node``, ``--intra-gbps``, ``--inter-gbps``, ``--stream-gbps``,
``--tflops``) and of the GPU kernel rates; a flag given on the command line
wins. ``--check-paper`` predicts Table 2 with them (``paper.py``). Where a
value is derived rather than read, the derivation is in ``paper.py`` and
tests/estimate re-derives it; docs/performance.md, "Validation (b)", shows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from megatron_sdp4bit.estimate.network import NCCL_LATENCY, Latency

A100_40GB_HBM_GBPS = 1555.0  # NVIDIA A100 datasheet, SXM4 40 GB: 1,555 GB/s
H800_HBM_GBPS = 3350.0       # NVIDIA H800 SXM5 datasheet: 3.35 TB/s


@dataclass(frozen=True)
class ClusterType:
    name: str
    description: str
    gpus_per_node: int
    nics_per_node: Optional[int]   # None: not known
    nic_gbps: Optional[float]      # line rate of one NIC, each direction
    inter_gbps: float              # what the node's NICs reach together (several streams)
    stream_gbps: Optional[float]   # what one stream reaches (None: it fills the node)
    intra_gbps: float              # per GPU, each direction, as NCCL reaches it
    tflops: float                  # achieved per GPU on the model's FLOPs (compute alone)
    kernel_scale: float            # x the paper's A100 kernel rates (kernels.py "gpu")
    latency: Latency
    sources: Tuple[Tuple[str, str], ...]  # (what, where it comes from)

    @property
    def line_gbps(self) -> Optional[float]:
        if self.nics_per_node is None or self.nic_gbps is None:
            return None
        return self.nics_per_node * self.nic_gbps


A100_SLINGSHOT = ClusterType(
    name="a100-slingshot",
    description="the paper's A100 cluster: 4 A100 per node, Slingshot at 100 Gbit/s",
    gpus_per_node=4, nics_per_node=2, nic_gbps=100.0,
    inter_gbps=180.0, stream_gbps=108.0,
    intra_gbps=1880.0, tflops=103.0, kernel_scale=1.0, latency=NCCL_LATENCY,
    sources=(
        ("4 GPUs per node, 100 Gbit/s Slingshot", "the paper (its experimental setup)"),
        ("2 NICs per node", "not stated by the paper. Its scripts ran at Indiana University "
         "(/N/slate paths), whose Big Red 200 GPU nodes were announced as architecturally "
         "similar to Perlmutter's; Perlmutter's phase-1 GPU nodes had 2 Slingshot-10 NICs "
         "('dual injection', NERSC). An inference, not a specification"),
        ("inter 180 / stream 108 Gbit/s per node", "derived from the paper's Table 4 (1.3B on "
         "32 A100s: gradient communication 379.3 ms exact, 45.8 ms SDP4Bit) with this model: "
         "one ring reaches 108, the node's NICs together 180 (90% of 2 x 100); "
         "paper.table4_rates()"),
        ("intra 1880 Gbit/s (235 GB/s)", "NCCL's bus-bandwidth cap for A100 NVLink "
         "(src/graph/tuning.cc at commit 01afd20, a 2020 release: busBw = min(busBw, 235) for "
         "compute capability 80)"),
        ("103 TFLOP/s", "Narayanan et al., SC 2021, Table 1: GPT 1.7B on 32 A100s reaches "
         "137 TFLOP/s counting activation recomputation (4 passes), i.e. 103 of model FLOPs "
         "(3 passes); measured end to end at batch 512, not at micro-batch 1"),
        ("kernels", "the paper's fused-quantize rates on A100 (305 GB/s at 8 MB, 690 at 2 GB)"),
        ("latency 8.4 / 3.4 / 14.0 / 3.0 us", "NCCL's tuning model, Simple protocol "
         "(src/graph/tuning.cc at commit b647562: baseLat, NVLink and network hwLat of a ring "
         "step, getNetOverhead x 3 per message posted; its Intel-host value, AMD hosts get 2x)"),
    ))

H800_IB = ClusterType(
    name="h800-ib",
    description="the paper's H800 cluster: 8 H800 per node, InfiniBand of unstated rate",
    gpus_per_node=8, nics_per_node=None, nic_gbps=None,
    inter_gbps=466.0, stream_gbps=None,
    intra_gbps=1280.0, tflops=139.0, kernel_scale=H800_HBM_GBPS / A100_40GB_HBM_GBPS,
    latency=NCCL_LATENCY,
    sources=(
        ("8 GPUs per node, InfiniBand", "the paper (its experimental setup)"),
        ("inter 466 Gbit/s per node, 139 TFLOP/s", "NO SOURCE: the paper states neither the "
         "InfiniBand rate nor a compute rate. Both are calibrated on two of its own H800 "
         "baselines (1.3B at TP 1, 18B at TP 8), so those two rows are calibration, not "
         "validation; paper.calibrate('h800-ib'). NIC count unknown: one stream is taken "
         "to fill the node (no H800 measurement like Table 4's)"),
        ("intra 1280 Gbit/s (160 GB/s)", "DeepSeek-V3 technical report (2024), H800 nodes: "
         "'NVLink offers a bandwidth of 160 GB/s'"),
        ("kernels x 2.15", "the paper's A100 rates x HBM bandwidth, H800 3.35 TB/s over "
         "A100 40 GB 1.555 TB/s (datasheets): the kernels are memory-bound. No H800 "
         "measurement"),
        ("latency 8.4 / 3.4 / 14.0 / 3.0 us", "NCCL's tuning model, as for the A100 cluster"),
    ))

CLUSTER_TYPES: Dict[str, ClusterType] = {t.name: t for t in (A100_SLINGSHOT, H800_IB)}
