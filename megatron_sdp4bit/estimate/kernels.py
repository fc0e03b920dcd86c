"""What the quantization kernels cost: measured tables, or a stated assumption.

Every figure is GB/s of the fp32 tensor being (de)quantized (for the
dequantize-sum ops: of all received chunks together), the normalisation of
``scripts/bench_quant.py`` (its ``input GB/s``), so time = 4 bytes x elements /
GB/s. The reduce-scatter's staging copy is priced at ``torch.clone``'s rate,
which moves the same 8 bytes per fp32 element (a read and a write).

- ``measured``: a file written by ``scripts/bench_quant.py --json`` (also by
  ``scripts/gpu_check.sh``) on the user's own device (``--kernel-rates``):
  each op by its ``key``, at the sizes measured, interpolated in log(size)
  and clamped outside (``MeasuredRates``).
- ``cpu``: the torch reference on this project's 2-core CPU, copied from
  docs/performance.md, "Quantization kernels", the "After (this reference)"
  table (``python scripts/bench_quant.py --sizes 8,64,512 --repeats 7``,
  2 intra-op threads), at 8, 64 and 512 MiB. A rank that has fewer cores than
  the table's 2 runs proportionally slower (``cores_per_rank``).
  ``tests/estimate`` checks these numbers against the doc.
- ``gpu``: no GPU (Triton) table has been measured in this project yet, so
  every op is *assumed* to run at the SDP4Bit paper's figure for its fused
  quantize kernel on an A100: 305 GB/s at 8 MB and 690 GB/s at 2 GB (log
  interpolation, clamped), or at one ``--kernel-gbps`` for every op; the copy
  at that rate x 4.5 / 8 (that kernel moves about 4.5 bytes per element, a
  copy 8, at the same memory bandwidth).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

CPU_TABLE_SIZES_MIB = (8.0, 64.0, 512.0)
CPU_TABLE_THREADS = 2
CLONE_ROW = "torch.clone (reference line)"
#: docs/performance.md, "Quantization kernels", "After (this reference)": GB/s at 8/64/512 MiB.
CPU_TABLE: Dict[str, Tuple[float, float, float]] = {
    CLONE_ROW: (12.26, 3.18, 3.43),
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
GPU_COPY_FACTOR = 4.5 / 8  # bytes the paper's quantize kernel moves per element / a copy's

# The kernels of each step of the collectives: the table row and bench_quant.py key that
# price them. Rows measured on a neighbouring format stand in where no row matches exactly.
OPS = {
    # op: (row, bench key, note)
    "grad_stage_rows": (CLONE_ROW, "clone", "the send-order copy before the first hop"),
    "grad_first_quantize_hadamard": ("hadamard_quantize 8-bit G=128 H=32",
                                     "hadamard_quantize_8bit", ""),
    "grad_first_quantize_plain": ("quantize 4-bit stochastic G=2048 (packed)",
                                  "quantize_4bit_stochastic",
                                  "row for G=2048 stands in for G=128, 8 or 4 bits, no Hadamard"),
    "grad_requantize": ("dequantize_sum_requantize 8->4-bit, 4 chunks",
                        "dequantize_sum_requantize_8to4", ""),
    "grad_final_sum": ("dequantize_sum 4-bit, 4 chunks + inverse H=32",
                       "dequantize_sum_4bit_hadamard",
                       "also used without the inverse Hadamard (TLq, ULq)"),
    "weight_quantize_diff": ("quantize_weight_diff 4-bit (fp32 - bf16)",
                             "quantize_weight_diff_4bit", ""),
    "weight_quantize_direct": ("quantize 4-bit stochastic G=2048 (packed)",
                               "quantize_4bit_stochastic", ""),
    "weight_apply_diff": ("dequantize_add_ 4-bit into bf16", "dequantize_add_4bit_bf16", ""),
    "weight_apply_direct": ("dequantize 4-bit G=2048 -> fp32", "dequantize_4bit_fp32",
                            "plus a copy, not counted"),
}


class KernelRatesError(ValueError):
    """A ``--kernel-rates`` file this model cannot read; the message says what is wrong."""


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
class MeasuredRates:
    """Input GB/s of each bench_quant.py key at the sizes (MiB) of one ``--json`` file."""

    sizes_mib: Tuple[float, ...]
    gbps: Dict[str, Tuple[float, ...]]
    device: str
    path: str

    @staticmethod
    def from_bench_json(path: str) -> "MeasuredRates":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise KernelRatesError(f"cannot read {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise KernelRatesError(f"{path} is not JSON ({exc.msg}, line {exc.lineno})") from None
        results = data.get("results") if isinstance(data, dict) else None
        if not results:
            raise KernelRatesError(f"{path} has no 'results': give a file written by "
                                   "scripts/bench_quant.py --json")
        try:
            results = sorted(results, key=lambda r: float(r["size_mib"]))
            rows = [{"clone": r["numel"] * 4 / r["clone"]["seconds"],
                     **{op["key"]: op["input_bytes_per_s"] for op in r["ops"]}} for r in results]
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise KernelRatesError(f"{path}: a result lacks {exc} (not a bench_quant.py "
                                   "--json file?)") from None
        needed = sorted({key for _, key, _ in OPS.values()})
        missing = [key for key in needed if any(key not in row for row in rows)]
        if missing:
            raise KernelRatesError(f"{path} lacks the ops {', '.join(missing)}: rerun "
                                   "scripts/bench_quant.py --json with this checkout")
        gbps = {key: tuple(row[key] / 1e9 for row in rows) for key in needed}
        if any(not v > 0 for values in gbps.values() for v in values):
            raise KernelRatesError(f"{path} has a rate that is not positive")
        return MeasuredRates(tuple(float(r["size_mib"]) for r in results), gbps,
                             str(data.get("device", "unknown device")), path)


@dataclass(frozen=True)
class KernelModel:
    """Seconds for a kernel op on ``numel`` fp32-equivalent elements."""

    table: str  # "cpu", "gpu" or "measured"
    fixed_gbps: Optional[float] = None  # gpu: one rate for every op
    cores_per_rank: float = CPU_TABLE_THREADS  # cpu: cores each rank gets
    measured: Optional[MeasuredRates] = None  # measured: the --kernel-rates file
    scale: float = 1.0  # gpu: the assumed rates times this (another GPU's memory bandwidth)

    def gbps(self, op: str, numel: int) -> float:
        row, key, _ = OPS[op]
        size_mib = numel * 4 / 2**20
        if self.table == "measured":
            return _log_interp(self.measured.sizes_mib, self.measured.gbps[key], size_mib)
        if self.table == "cpu":
            rate = _log_interp(CPU_TABLE_SIZES_MIB, CPU_TABLE[row], size_mib)
            return rate * self.cores_per_rank / CPU_TABLE_THREADS
        if self.fixed_gbps is not None:
            rate = self.fixed_gbps
        else:
            rate = _log_interp(GPU_ASSUMED_SIZES_MIB, GPU_ASSUMED_GBPS, size_mib) * self.scale
        return rate * (GPU_COPY_FACTOR if key == "clone" else 1.0)

    @property
    def shares_compute(self) -> bool:
        """The kernels run on the cores the model's compute runs on (the CPU table, or
        rates measured on a CPU): work beside the backward pass slows it by as much."""
        if self.table == "measured":
            return "cpu" in self.measured.device.lower()
        return self.table == "cpu"

    def seconds(self, op: str, numel: int) -> float:
        if numel <= 0:
            return 0.0
        return numel * 4 / (self.gbps(op, numel) * 1e9)

    def describe(self) -> str:
        if self.table == "measured":
            return (f"measured: {self.measured.path} ({self.measured.device}), "
                    f"{'/'.join(f'{s:g}' for s in self.measured.sizes_mib)} MiB, log-interpolated")
        if self.table == "cpu":
            scale = "" if self.cores_per_rank == CPU_TABLE_THREADS else (
                f", scaled by {self.cores_per_rank:g}/{CPU_TABLE_THREADS} cores per rank")
            return ("measured: docs/performance.md 'Quantization kernels', CPU torch reference "
                    f"(2 threads), 8/64/512 MiB columns, log-interpolated{scale}")
        if self.fixed_gbps is not None:
            return (f"ASSUMED: every op at {self.fixed_gbps:g} GB/s of fp32 input "
                    "(--kernel-gbps; give --kernel-rates FILE for measured ones)")
        scaled = f" x {self.scale:.3g}" if self.scale != 1.0 else ""
        return ("ASSUMED: every op at the SDP4Bit paper's A100 fused-quantize rate, 305 GB/s at "
                f"8 MB to 690 GB/s at 2 GB of fp32{scaled} (give --kernel-rates FILE, written "
                "by scripts/bench_quant.py --json on your GPU, for measured ones)")
