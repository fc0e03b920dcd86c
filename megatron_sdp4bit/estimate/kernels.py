"""What the quantization kernels cost: measured tables, or a stated assumption.

Every figure is GB/s of the fp32 tensor being (de)quantized (for the
dequantize-sum ops: of all received chunks together), the normalisation of
``scripts/bench_quant.py``, so time = 4 bytes x elements / GB/s.

- ``cpu``: the torch reference on this project's 2-core CPU, copied from
  docs/performance.md, "Quantization kernels", the "After (this reference)"
  table (``python scripts/bench_quant.py --sizes 8,64,512 --repeats 7``,
  2 intra-op threads), at 8, 64 and 512 MiB; interpolated in log(size)
  between them and clamped outside. A rank that has fewer cores than the
  table's 2 runs proportionally slower (``cores_per_rank``).
  ``tests/estimate`` checks these numbers against the doc.
- ``gpu``: no GPU (Triton) table has been measured in this project yet, so
  every op is *assumed* to run at the SDP4Bit paper's figure for its fused
  quantize kernel on an A100: 305 GB/s at 8 MB and 690 GB/s at 2 GB (log
  interpolation, clamped), or at one ``--kernel-gbps`` for every op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

CPU_TABLE_SIZES_MIB = (8.0, 64.0, 512.0)
CPU_TABLE_THREADS = 2
#: docs/performance.md, "Quantization kernels", "After (this reference)": GB/s at 8/64/512 MiB.
CPU_TABLE: Dict[str, Tuple[float, float, float]] = {
    "quantize 4-bit stochastic G=2048 (packed)": (0.76, 1.37, 1.29),
    "dequantize 4-bit G=2048 -> fp32": (2.18, 2.10, 2.47),
    "quantize_weight_diff 4-bit (fp32 - bf16)": (0.81, 1.30, 1.25),
    "dequantize_add_ 4-bit into bf16": (1.49, 2.55, 3.00),
    "hadamard_quantize 8-bit G=128 H=32": (0.50, 0.75, 0.75),
    "dequantize_sum_requantize 8->4-bit, 4 chunks": (1.58, 2.38, 3.18),
    "dequantize_sum 4-bit, 4 chunks + inverse H=32": (1.54, 2.10, 2.32),
}
GPU_ASSUMED_SIZES_MIB = (8e6 / 2**20, 2e9 / 2**20)  # 8 MB and 2 GB, in MiB
GPU_ASSUMED_GBPS = (305.0, 690.0)

# The kernels of each step of the collectives, and the table row that prices them.
# Rows measured on a neighbouring format stand in where no row matches exactly.
OPS = {
    # op: (row, note)
    "grad_first_quantize_hadamard": ("hadamard_quantize 8-bit G=128 H=32", ""),
    "grad_first_quantize_plain": ("quantize 4-bit stochastic G=2048 (packed)",
                                  "row for G=2048 stands in for G=128, 8 or 4 bits, no Hadamard"),
    "grad_requantize": ("dequantize_sum_requantize 8->4-bit, 4 chunks", ""),
    "grad_final_sum": ("dequantize_sum 4-bit, 4 chunks + inverse H=32",
                       "also used without the inverse Hadamard (TLq, ULq)"),
    "weight_quantize_diff": ("quantize_weight_diff 4-bit (fp32 - bf16)", ""),
    "weight_quantize_direct": ("quantize 4-bit stochastic G=2048 (packed)", ""),
    "weight_apply_diff": ("dequantize_add_ 4-bit into bf16", ""),
    "weight_apply_direct": ("dequantize 4-bit G=2048 -> fp32", "plus a copy, not counted"),
}


def _log_interp(sizes, values, size: float) -> float:
    if size <= sizes[0]:
        return values[0]
    if size >= sizes[-1]:
        return values[-1]
    for (s0, v0), (s1, v1) in zip(zip(sizes, values), zip(sizes[1:], values[1:])):
        if size <= s1:
            t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return v0 + t * (v1 - v0)
    return values[-1]


@dataclass(frozen=True)
class KernelModel:
    """Seconds for a kernel op on ``numel`` fp32-equivalent elements."""

    table: str  # "cpu" or "gpu"
    fixed_gbps: Optional[float] = None  # gpu: one rate for every op
    cores_per_rank: float = CPU_TABLE_THREADS  # cpu: cores each rank gets

    def gbps(self, op: str, numel: int) -> float:
        row = OPS[op][0]
        size_mib = numel * 4 / 2**20
        if self.table == "cpu":
            rate = _log_interp(CPU_TABLE_SIZES_MIB, CPU_TABLE[row], size_mib)
            return rate * self.cores_per_rank / CPU_TABLE_THREADS
        if self.fixed_gbps is not None:
            return self.fixed_gbps
        return _log_interp(GPU_ASSUMED_SIZES_MIB, GPU_ASSUMED_GBPS, size_mib)

    def seconds(self, op: str, numel: int) -> float:
        if numel <= 0:
            return 0.0
        return numel * 4 / (self.gbps(op, numel) * 1e9)

    def describe(self) -> str:
        if self.table == "cpu":
            scale = "" if self.cores_per_rank == CPU_TABLE_THREADS else (
                f", scaled by {self.cores_per_rank:g}/{CPU_TABLE_THREADS} cores per rank")
            return ("measured: docs/performance.md 'Quantization kernels', CPU torch reference "
                    f"(2 threads), 8/64/512 MiB columns, log-interpolated{scale}")
        if self.fixed_gbps is not None:
            return (f"ASSUMED: every op at {self.fixed_gbps:g} GB/s of fp32 input "
                    "(--kernel-gbps; no GPU kernel table measured in docs/performance.md)")
        return ("ASSUMED: no GPU kernel table in docs/performance.md; every op at the SDP4Bit "
                "paper's A100 fused-quantize rate, 305 GB/s at 8 MB to 690 GB/s at 2 GB of fp32")
