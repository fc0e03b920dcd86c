"""What ``scripts/bench_slow_link.py`` trains and compares: the model, the presets, the nodes.

Presets: ``baseline`` (exact collectives; gloo's reduce_scatter is a ring
*all-reduce*, twice a ring reduce-scatter's bytes), ``baseline-a2a`` (exact, with
the reduce-scatter as an all-to-all plus local sum, ``comm/exact_alltoall.py``, the
driver's ``--sdp4bit-exact-reduce-scatter alltoall``: the bytes per rank of a ring
reduce-scatter), ``sdp4bit``, ``sdp4bit-flat-gather`` (its weight all-gather as one
ring over the 4 ranks, ``--sdp4bit-weight-gather flat``, instead of two hops),
``zeropp``; and each of them with ``-overlap``:
Megatron's ``--overlap-grad-reduce --overlap-param-gather`` with buckets of
``OVERLAP_BUCKET_SIZE`` parameters (4 buckets of the 5.3 M-parameter model, the last
with the tied embeddings: 40% of the elements), the
overlap study's rows.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

from megatron_sdp4bit.benchmarks.emulated_nodes import NUM_NODES
from megatron_sdp4bit.estimate.implementation import THIS_PROJECT
from megatron_sdp4bit.recipes import SLOW_LINK

RANKS_PER_NODE = 2
RANKS = NUM_NODES * RANKS_PER_NODE
GLOBAL_BATCH, SEQ_LENGTH = SLOW_LINK.global_batch_size, SLOW_LINK.seq_length
LR_WARMUP_ITERS = SLOW_LINK.lr_warmup_iters  # megatron's scheduler needs more iterations than this
# The `make train` model (5.3 M params) on the embedded corpus; no evaluation
# until the end (one batch), so every logged step is a training step.
MODEL_FLAGS = SLOW_LINK.flags()
NUM_LAYERS = SLOW_LINK.num_layers


def model_flags(num_layers: int = NUM_LAYERS) -> List[str]:
    """The driver's model flags with ``num_layers`` layers (``--num-layers``: a deeper
    model puts a smaller share of its bytes in the embedding bucket, which overlap
    cannot hide)."""
    return SLOW_LINK.replace(num_layers=num_layers).flags()

PRESET_FLAGS = {
    "baseline": ["--sdp4bit-preset", "baseline", "--use-distributed-optimizer"],
    "baseline-a2a": ["--sdp4bit-preset", "baseline", "--use-distributed-optimizer",
                     "--sdp4bit-exact-reduce-scatter", "alltoall"],
    "sdp4bit": ["--sdp4bit"],
    "sdp4bit-flat-gather": ["--sdp4bit", "--sdp4bit-weight-gather", "flat"],
    "zeropp": ["--sdp4bit-preset", "zeropp"],
}
PRESET_LABELS = {"baseline": "exact (gloo reduce_scatter, fp32)",
                 "baseline-a2a": "exact, reduce-scatter as all-to-all (fp32)",
                 "sdp4bit": "SDP4Bit (qWD 4-bit, TLq-HS 8/4)",
                 "sdp4bit-flat-gather": "SDP4Bit, weight gather flat (one ring)",
                 "zeropp": "ZeRO++ (qW 4-bit, ULq 4/4)"}
OVERLAP = "-overlap"
OVERLAP_BUCKET_SIZE = 1_000_000  # parameters per bucket: 4 buckets of the 5.3 M model
OVERLAP_FLAGS = ["--overlap-grad-reduce", "--overlap-param-gather",
                 "--bucket-size", str(OVERLAP_BUCKET_SIZE)]
for _name in list(PRESET_FLAGS):
    PRESET_FLAGS[_name + OVERLAP] = PRESET_FLAGS[_name] + OVERLAP_FLAGS
    PRESET_LABELS[_name + OVERLAP] = PRESET_LABELS[_name] + ", overlapped"
DRIVER_ENTRY = ["-m", "megatron_sdp4bit.pretrain"]  # what each rank runs
# How the estimator sees each preset: (variant, exact reduce-scatter algorithm,
# implementation).
PRESET_ESTIMATE = {"baseline": ("baseline", "allreduce", THIS_PROJECT),
                   "baseline-a2a": ("baseline", "alltoall", THIS_PROJECT),
                   "sdp4bit": ("sdp4bit", "ring", THIS_PROJECT),
                   "sdp4bit-flat-gather": ("sdp4bit", "ring",
                                           replace(THIS_PROJECT, two_level_weight_gather=False)),
                   "zeropp": ("zeropp", "ring", THIS_PROJECT)}


def base_preset(preset: str) -> str:
    """``sdp4bit-overlap`` -> ``sdp4bit``."""
    return preset[:-len(OVERLAP)] if preset.endswith(OVERLAP) else preset


def overlapped(preset: str) -> bool:
    return preset.endswith(OVERLAP)
STATISTICS = ("median", "fastest")  # step statistics compared with the estimator
FIRST_PORT = 29600  # inside the private namespaces every port is free


def rate_label(rate) -> str:
    """A link rate in Mbit/s as the tables and the JSON name it (None: no limit)."""
    return "no limit (veth)" if rate is None else f"{rate:g} Mbit/s"


def dtype_flags(dtype: str) -> list:
    return ["--bf16"] if dtype == "bf16" else []
