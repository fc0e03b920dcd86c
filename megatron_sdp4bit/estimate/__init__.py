"""``sdp4bit-estimate``: predicted step time and DP communication of baseline, ZeRO++, SDP4Bit.

- ``gpt_shape.py``: the GPT of a config file, its parameters per TP/PP rank, megatron's buckets, FLOPs;
- ``volume.py``: bytes each rank sends (mirroring ``comm``'s accounting) and bytes on each link;
- ``implementation.py`` / ``calls.py``: how the collectives split a bucket into calls and
  messages (this project's, or the paper's reference code), the staging copy;
- ``network.py``: link rates, streams per node, latency per call, step and message;
- ``kernels.py``: quantization kernel costs (a ``bench_quant.py --json`` file, the measured
  CPU table, or stated GPU assumptions);
- ``timing.py``: the step-time model (compute, TP, communication, kernels, overlap);
- ``clusters.py`` / ``paper.py``: the paper's two clusters with sourced constants, its
  Table 2 (``--check-paper``) and the break-even link rates (``--break-even``);
- ``output.py`` / ``cli.py``: output and the command line (``python -m megatron_sdp4bit.estimate``).

Method, assumptions and validation: docs/performance.md, "Estimator". Importing the
package is light (the command line checks its flags before torch is imported);
``estimate``, ``Cluster``, ``Workload`` and ``Estimate`` load ``timing`` on first use.
"""
__all__ = ["Cluster", "Workload", "Estimate", "estimate"]


def __getattr__(name):
    if name in __all__:
        from megatron_sdp4bit.estimate import timing

        return getattr(timing, name)
    raise AttributeError(f"module 'megatron_sdp4bit.estimate' has no attribute {name!r}")
