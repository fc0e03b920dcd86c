"""Model shapes, megatron's bucket layout, kernel tables and the step-time model."""
from __future__ import annotations

import os
import re

import pytest

from megatron_sdp4bit.estimate import kernels as kernel_tables
from megatron_sdp4bit.estimate.kernels import KernelModel
from megatron_sdp4bit.estimate.gpt_shape import (ModelShape, bucket_numels, load_model_shape,
                                             stage_params, total_params)
from megatron_sdp4bit.estimate.network import NO_LATENCY
from megatron_sdp4bit.estimate.overlap import chain_gather_exposed, chain_reduce_scatter_exposed
from megatron_sdp4bit.estimate.timing import Cluster, Workload, estimate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.startswith("gpt_"))

# megatron-core 0.16.1's own numbers for three driver models (1 CPU rank, DP 1), from
# build_model() of megatron_sdp4bit.training.model: parameter count and the DDP buckets'
# grad_data sizes (4 x 256: the `make train` / bench_slow_link model, one bucket).
MEGATRON_BUCKETS = [
    # (layers, hidden, seq, vocab, untied, bucket_size) -> (params, buckets)
    ((4, 256, 128, 8192, False, None), (5289472, [5289472])),
    ((3, 192, 64, 1000, False, 200000), (1543872, [296320, 296704, 259840, 333312, 357888])),
    ((2, 128, 64, 777, True, 100000), (634368, [114688, 131968, 132224, 115840, 139648])),
]


def _shape(layers, hidden, seq, vocab, untied, micro=4, global_batch=None):
    return ModelShape("test", layers, hidden, 4, 4 * hidden, seq, seq, vocab, untied, micro,
                      global_batch)


@pytest.mark.parametrize("case", MEGATRON_BUCKETS, ids=lambda c: f"{c[0][0]}x{c[0][1]}")
def test_parameters_and_buckets_match_megatron(case):
    (layers, hidden, seq, vocab, untied, bucket), (params, buckets) = case
    stage = stage_params(_shape(layers, hidden, seq, vocab, untied), 1, 1, 0)
    assert stage.numel == params
    assert bucket_numels(stage, 1, bucket) == buckets


def test_buckets_pad_to_lcm_of_dp_and_128_and_split_shared_embeddings():
    stage = stage_params(_shape(4, 256, 128, 8192, False), 1, 1, 0)
    (one,) = bucket_numels(stage, 6, None)
    assert one % 384 == 0 and 0 <= one - stage.numel < 384
    first, last = (stage_params(_shape(4, 256, 128, 8192, False), 1, 2, s) for s in (0, 1))
    assert first.tensors[0][2] and last.tensors[-1][2]  # tied embeddings shared across stages
    assert len(bucket_numels(last, 2, None)) == 2       # the shared copy gets its own bucket


def test_tp_and_pp_split_the_parameters():
    shape = load_model_shape(os.path.join(REPO, "configs", "gpt_1.3b.yaml"))
    whole = total_params(shape)
    assert 1.2e9 < whole < 1.45e9
    tp4 = stage_params(shape, 4, 1, 0).numel
    assert whole / 4 < tp4 < whole / 4 * 1.02  # norms, some biases, positions replicated; vocab padded to 512
    pp2 = [stage_params(shape, 1, 2, s).numel for s in (0, 1)]
    assert abs(sum(pp2) - whole - shape.padded_vocab(1) * shape.hidden_size) < 10  # tied copy


def test_configs_load_as_the_driver_reads_them():
    shape = load_model_shape(os.path.join(REPO, "configs", "gpt_6.7b.yaml"))
    assert (shape.num_layers, shape.hidden_size, shape.seq_length) == (32, 4096, 2048)
    assert shape.vocab_size == 50257 and shape.padded_vocab(1) == 50304
    assert shape.global_batch_size == 256 and shape.ffn_hidden_size == 4 * 4096
    assert load_model_shape(None).vocab_size == 8192  # the embedded corpus's tokenizer


def _doc_cpu_table() -> dict:
    """The 'After (this reference)' table of docs/performance.md: row -> GB/s at 8/64/512 MiB."""
    text = open(os.path.join(REPO, "docs", "performance.md"), encoding="utf-8").read()
    section = text.split("After (this reference):", 1)[1].split("Before (", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.match(r"^[\d.]+$", cells[1]):
            rows[cells[0]] = tuple(float(cells[i]) for i in (1, 3, 5))
    return rows


def test_cpu_kernel_numbers_are_the_docs_table():
    doc = _doc_cpu_table()
    for row, values in kernel_tables.CPU_TABLE.items():
        assert doc.get(row) == values, f"{row}: estimator {values}, docs/performance.md {doc.get(row)}"
    for row, _, _ in kernel_tables.OPS.values():
        assert row in kernel_tables.CPU_TABLE


def test_kernel_rates_interpolate_and_scale():
    cpu = KernelModel("cpu")
    numel_64mib = 64 * 2**20 // 4
    assert cpu.gbps("weight_apply_diff", numel_64mib) == pytest.approx(2.55)
    assert cpu.gbps("weight_apply_diff", 10) == pytest.approx(1.49)  # clamped below 8 MiB
    assert 1.49 < cpu.gbps("weight_apply_diff", numel_64mib // 2) < 2.55
    half = KernelModel("cpu", cores_per_rank=0.5)
    assert half.seconds("grad_requantize", numel_64mib) == pytest.approx(
        4 * cpu.seconds("grad_requantize", numel_64mib))
    gpu = KernelModel("gpu")
    assert gpu.gbps("grad_requantize", 10**9) == pytest.approx(690.0)
    assert KernelModel("gpu", fixed_gbps=1000).gbps("weight_apply_diff", 5) == 1000


# --- the step-time model ---------------------------------------------------------------

SMALL = _shape(4, 256, 128, 8192, False, micro=4, global_batch=64)


def _estimate(nodes=2, gpus=4, tp=1, pp=1, intra=100.0, inter=10.0, tflops=1.0,
              latency=NO_LATENCY, stream=None, **work):
    cluster = Cluster(nodes, gpus, tp, pp, intra, inter, stream, latency)
    workload = Workload(shape=SMALL, global_batch=64 if nodes * gpus // (tp * pp) <= 16 else
                        4 * nodes * gpus // (tp * pp), micro_batch=4, tflops=tflops, **work)
    return estimate(cluster, workload, KernelModel("gpu"))


def test_dp_one_has_no_data_parallel_communication():
    for nodes, gpus, tp in ((1, 1, 1), (1, 4, 4)):
        e = _estimate(nodes=nodes, gpus=gpus, tp=tp)
        assert e.cluster.dp == 1
        for v in e.variants.values():
            assert v.sent.total == 0 and v.sent.exact_intra + v.sent.exact_inter == 0
            assert v.comm_s == 0 and v.kernel_s == 0 and v.embedding_s == 0
            assert v.step_s == pytest.approx(e.compute_s + v.tp_comm_s)
            assert (v.tp_comm_s > 0) == (tp > 1)  # TP 4: the tensor-parallel all-reduces


def test_more_bandwidth_or_compute_never_takes_longer():
    for overlap in ("none", "grads", "full"):
        previous = None
        for inter in (0.1, 1.0, 10.0, 100.0):
            for intra in (10.0, 100.0):
                e = _estimate(inter=inter, intra=intra, overlap=overlap)
                steps = {n: v.step_s for n, v in e.variants.items()}
                if previous is not None and intra == 10.0:
                    assert all(steps[n] <= previous[n] + 1e-12 for n in steps), (overlap, inter)
                if intra == 10.0:
                    previous = steps
        slow, fast = _estimate(tflops=1.0, overlap=overlap), _estimate(tflops=2.0, overlap=overlap)
        assert all(fast.variants[n].step_s < slow.variants[n].step_s for n in fast.variants)


def test_quantized_variants_send_fewer_bytes_and_win_on_a_slow_link():
    e = _estimate(inter=1.0)
    base, sdp, zpp = (e.variants[n] for n in ("baseline", "sdp4bit", "zeropp"))
    assert sdp.node_inter_bytes < base.node_inter_bytes / 6
    assert zpp.node_inter_bytes == sdp.node_inter_bytes  # both 4 bits across nodes
    assert sdp.sent.intra > zpp.sent.intra              # 8-bit intra-node hop vs 4-bit
    assert e.speedup("sdp4bit") > 2 and e.speedup("zeropp") > 2


def test_overlap_hides_communication_but_not_the_last_buckets():
    none = _estimate(inter=1.0, overlap="none", bucket_size=500_000)
    full = _estimate(inter=1.0, overlap="full", bucket_size=500_000)
    assert len(full.buckets[0]) > 1
    for name in full.variants:
        assert full.variants[name].step_s <= none.variants[name].step_s
        # the last bucket's reduce-scatter completes after the backward pass
        v = full.variants[name]
        assert v.grad_exposed_s >= v.grad_comm_s / len(full.buckets[0]) - 1e-12


def test_overlap_hides_behind_one_micro_batchs_pass():
    """Megatron reduces the gradients in the last micro-batch's backward pass only and
    gathers the weights in the first one's forward: with 4 micro-batches per step the
    windows are those of a step of a quarter of the compute and one micro-batch."""
    cluster = Cluster(2, 4, 1, 1, 100.0, 1.0)
    for runner in ("stream", "deferred"):
        def run(global_batch, compute_s):
            return estimate(cluster, Workload(shape=SMALL, global_batch=global_batch, micro_batch=4,
                                              compute_s=compute_s, overlap="full",
                                              bucket_size=500_000, runner=runner),
                            KernelModel("gpu"))
        four, one = run(128, 0.4), run(32, 0.1)  # passes shorter than the collectives
        assert four.microbatches == 4 and one.microbatches == 1
        for name, v in four.variants.items():
            assert v.grad_exposed_s == pytest.approx(one.variants[name].grad_exposed_s)
            assert v.weight_exposed_s == pytest.approx(one.variants[name].weight_exposed_s)
            assert v.grad_exposed_s > 0.05 * v.grad_comm_s  # a quarter of the pass hides less


@pytest.mark.parametrize("comm, window", [(0.2, 1.0), (1.0, 1.0), (3.0, 1.0)])
def test_equal_buckets_expose_the_last_one_or_the_excess(comm, window):
    """With B equal buckets the queue gives the closed form: the last bucket's share,
    or what the chain has beyond the window of the B - 1 buckets before it."""
    for buckets in (1, 2, 4, 8):
        shares = [1 / buckets] * buckets
        closed = max(comm / buckets, comm - window * (buckets - 1) / buckets)
        assert chain_reduce_scatter_exposed(comm, window, shares) == pytest.approx(closed)
        assert chain_gather_exposed(comm, window, shares) == pytest.approx(closed)


def test_the_bucket_reduced_last_and_gathered_first_is_never_hidden():
    """The reduce-scatter's last bucket starts when the backward pass ends; the forward
    pass's first bucket (megatron's last) waits for its gather. However long the
    passes, that bucket's share of each chain stays exposed."""
    shares = [0.2, 0.2, 0.2, 0.4]   # the embedding bucket last, as in bench_slow_link's model
    assert chain_reduce_scatter_exposed(1.0, 100.0, shares) == pytest.approx(0.4)
    assert chain_gather_exposed(1.0, 100.0, shares) == pytest.approx(0.4)
    assert chain_gather_exposed(1.0, 100.0, shares[::-1]) == pytest.approx(0.2)


def test_the_slow_link_models_embedding_bucket_is_the_floor_of_its_overlap():
    """bench_slow_link's overlap presets: 4 buckets of 1 M, the last (tied embeddings)
    40% of the elements; overlapped, at least that share of each direction stays out."""
    from megatron_sdp4bit.benchmarks.slow_link.presets import MODEL_FLAGS, OVERLAP_BUCKET_SIZE
    shape = load_model_shape(None, driver_argv=MODEL_FLAGS)
    e = estimate(Cluster(2, 2, 1, 1, 10.0, 0.1),
                 Workload(shape=shape, global_batch=16, micro_batch=4, compute_s=10.0,
                          overlap="full", bucket_size=OVERLAP_BUCKET_SIZE, param_element_size=4),
                 KernelModel("cpu"), ["baseline", "sdp4bit"])
    numels = e.buckets[0]
    assert len(numels) == 4 and numels[-1] / sum(numels) == pytest.approx(0.403, abs=0.001)
    for v in e.variants.values():
        assert v.grad_exposed_s >= 0.4 * v.grad_comm_s
        assert v.weight_exposed_s >= 0.4 * v.weight_comm_s
        assert v.grad_exposed_s < 0.41 * v.grad_comm_s  # 10 s of compute hide the rest


def test_exact_reduce_scatter_algorithms_order_by_bytes():
    ring, a2a, allreduce = (_estimate(exact_reduce_scatter=a).variants["baseline"]
                            for a in ("ring", "alltoall", "allreduce"))
    assert ring.grad_comm_s < a2a.grad_comm_s and ring.grad_comm_s < allreduce.grad_comm_s
    assert allreduce.grad_comm_s == pytest.approx(2 * ring.grad_comm_s)
    assert ring.sent == a2a.sent == allreduce.sent  # accounting counts direct sends regardless


def test_bytes_of_the_slow_link_model_match_the_drivers_accounting():
    """bench_slow_link's model on 2 x 2 ranks: MiB sent per rank and step as the driver logged
    them (docs/performance.md, slow-link tables: bf16 runs; fp32 runs of the estimator section)."""
    shape = load_model_shape(None, driver_argv=["--num-layers", "4", "--hidden-size", "256",
                                                "--num-attention-heads", "4", "--seq-length", "128",
                                                "--micro-batch-size", "4"])
    for param_bytes, expected in ((2, {"baseline": 22.70, "sdp4bit": 5.17, "zeropp": 3.91}),
                                  (4, {"baseline": 30.27, "sdp4bit": 5.17, "zeropp": 3.91})):
        e = estimate(Cluster(2, 2, 1, 1, 10.0, 1.0),
                     Workload(shape=shape, global_batch=16, micro_batch=4, compute_s=1.0,
                              param_element_size=param_bytes), KernelModel("cpu"))
        got = {n: round(v.sent.total / 2**20, 2) for n, v in e.variants.items()}
        assert got == expected
        inter = {n: round(v.sent.inter / 2**20, 2) for n, v in e.variants.items()}
        # the quantized gathers in two hops: 1.30 across nodes (the flat gathers of the
        # tables before 2026-12-06 logged 1.94), the same total
        assert inter["sdp4bit"] == inter["zeropp"] == 1.30


def test_memory_follows_the_gather_the_implementation_makes():
    """On 2 nodes x 4 the two-hop weight gather adds a reordered copy of the gathered
    segments (comm/gather_hops.py); an implementation that gathers flat (the paper's
    code, the slow-link bench's flat-gather preset) is counted without it, as the
    config that asks for the flat gather is."""
    from dataclasses import replace
    from megatron_sdp4bit.comm.memory_plan import layer_memory
    from megatron_sdp4bit.estimate.implementation import THIS_PROJECT
    e = _estimate()
    config, two_hops = e.variants["sdp4bit"].config, e.variants["sdp4bit"].memory
    flat_impl = _estimate(implementation=replace(THIS_PROJECT, two_level_weight_gather=False))

    def counted(weight_gather):
        return layer_memory(e.buckets[0], 8, replace(config, weight_gather=weight_gather),
                            params=two_hops.params, node_members=4, fp32_params=False)
    assert two_hops == counted("two-level")
    assert flat_impl.variants["sdp4bit"].memory == counted("flat")
    assert counted("flat").buffer_bytes < two_hops.buffer_bytes
