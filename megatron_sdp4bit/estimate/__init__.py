"""``sdp4bit-estimate``: predicted step time and DP communication of baseline, ZeRO++, SDP4Bit.

- ``model.py``: the GPT of a config file, its parameters per TP/PP rank, megatron's buckets, FLOPs;
- ``volume.py``: bytes each rank sends (mirroring ``comm``'s accounting) and bytes on each link;
- ``kernels.py``: quantization kernel costs (the measured CPU table, or stated GPU assumptions);
- ``timing.py``: the step-time model (compute, communication, kernels, overlap);
- ``report.py`` / ``cli.py``: output and the command line (``python -m megatron_sdp4bit.estimate``).

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
