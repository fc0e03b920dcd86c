"""The link model's new terms: streams per node, latency per call and message (against the
calls the real collectives make), the staging copy, tensor-parallel and embedding all-reduces."""
from __future__ import annotations

import dataclasses

import pytest

from estimate_cases import CALL_CASES, FLOORS, count_calls
from harness import spawn_ranks
from megatron_sdp4bit.comm.layout import plan_node_layout
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.estimate import calls, volume
from megatron_sdp4bit.estimate.implementation import (PAPER_REFERENCE, THIS_PROJECT,
                                                      Implementation)
from megatron_sdp4bit.estimate.kernels import KernelModel
from megatron_sdp4bit.estimate.gpt_shape import ModelShape, tp_allreduces
from megatron_sdp4bit.estimate.network import (NCCL_LATENCY, NO_LATENCY, Latency,
                                               Network, ring_calls)
from megatron_sdp4bit.estimate.timing import Cluster, Workload, estimate

WORLD = 4


def test_one_ring_is_held_to_the_stream_rate_several_fill_the_node():
    layout = plan_node_layout(range(8), 4)  # one DP group, 2 nodes x 4
    ring = volume.ring_links(layout, layout.ranks, 1000)
    assert ring.node_streams == {0: 1, 1: 1}  # one ring leaves each node once
    net = Network(intra_gbps=1e6, inter_gbps=200.0, stream_gbps=100.0)
    one = net.phase_seconds(ring)
    assert one == pytest.approx(7 * 1000 * 8 / 100e9)
    four = volume.Links.empty()  # four DP groups (TP 4) on the same two nodes, at once
    for _ in range(4):
        four.merge(ring)
    assert four.node_streams == {0: 4, 1: 4}
    assert net.phase_seconds(four) == pytest.approx(4 * 7 * 1000 * 8 / 200e9)
    later = volume.Links.empty()  # the next bucket of the same group: not concurrent
    later.merge(ring, concurrent=False)
    later.merge(ring, concurrent=False)
    assert later.node_streams == {0: 1, 1: 1} and later.node_inter[0] == 2 * 7000
    hop = volume.reduce_scatter_links(10_000, 4, layout, preset("sdp4bit"), "ring").phases[1][1]
    assert hop.node_streams == {0: 4, 1: 4}  # an all-to-all sends from every GPU
    assert Network(1e6, 200.0, None).node_gbps(1) == 200.0


def test_latency_follows_nccl_ring_steps_and_pairwise_all_to_alls():
    steps = ring_calls(128, 16)
    assert (steps.calls, steps.intra_steps, steps.inter_steps, steps.messages) == (1, 112, 15, 0)
    assert NCCL_LATENCY.seconds(steps) == pytest.approx((8.4 + 112 * 3.4 + 15 * 14.0) * 1e-6)
    layout = plan_node_layout(range(8), 4)
    config = dataclasses.replace(preset("sdp4bit"), pipeline_chunks=3)
    impl = Implementation("t", messages_per_peer=2, max_chunk_elements=None,
                          sliced_weight_gather=False, staging_copy=True)
    rs = calls.reduce_scatter_calls(30_000, layout, config, "ring", impl)
    # 3 chunks x 2 calls (codes, scales) x (intra hop: one NVLink traversal; inter hop: one
    # network traversal and 1 message posted to the other node)
    assert (rs.calls, rs.intra_steps, rs.inter_steps, rs.messages) == (12, 6, 6, 6)
    assert NCCL_LATENCY.seconds(rs) == pytest.approx((12 * 8.4 + 6 * 3.4 + 6 * 14.0 + 6 * 3.0) * 1e-6)
    flat = plan_node_layout(range(16), 1)  # one rank per node: 15 messages, one traversal
    hop = calls.reduce_scatter_calls(30_000, flat, config, "ring", impl)
    assert (hop.calls, hop.intra_steps, hop.inter_steps, hop.messages) == (6, 0, 6, 6 * 15)
    exact = calls.reduce_scatter_calls(30_000, layout, preset("baseline"), "allreduce", impl)
    assert (exact.calls, exact.intra_steps, exact.inter_steps, exact.messages) == (1, 12, 2, 0)


@pytest.fixture(scope="module")
def recorded_calls():
    return spawn_ranks(count_calls, WORLD, timeout_s=240, start="forkserver")


def test_chunks_and_slices_are_the_real_collectives_calls(recorded_calls):
    """The estimator's pipeline chunks and all-gather slices (``MAX_CHUNK_ELEMENTS`` capped)
    are the real collectives': calls = chunks x hops x messages per peer, whatever that
    constant of comm/ is (the same in every case)."""
    real = recorded_calls[0]
    per_hop, per_slice = set(), set()
    for rpn, shard, cap in CALL_CASES:
        layout = plan_node_layout(range(WORLD), rpn)
        config = preset("sdp4bit", ranks_per_node=rpn)
        impl = dataclasses.replace(THIS_PROJECT, max_chunk_elements=cap, messages_per_peer=1,
                                   min_chunk_shard_elements=FLOORS[0], min_slice_elements=FLOORS[1])
        model = calls.reduce_scatter_calls(shard, layout, config, "ring", impl)
        a2a, ag = real[(rpn, shard, cap, None)]
        assert a2a % model.calls == 0, (rpn, shard, cap, a2a, model.calls)
        per_hop.add(a2a // model.calls)
        slices = calls.weight_slices(shard, layout, config, impl)
        assert ag % slices == 0, (rpn, shard, cap, ag, slices)
        per_slice.add(ag // slices)
    assert len(per_hop) == 1 and len(per_slice) == 1  # chunk and slice counts match everywhere
    capped = dataclasses.replace(THIS_PROJECT, max_chunk_elements=4096,  # the cases exercise caps
                                 min_chunk_shard_elements=FLOORS[0])
    assert len(volume.grad_chunks(4101, plan_node_layout(range(WORLD), 2), preset("sdp4bit"),
                                  capped)) == 5


def test_staging_copy_is_one_switch():
    layout = plan_node_layout(range(8), 4)
    config = preset("sdp4bit")
    staged = calls.staging_elements(10_240, layout, config, THIS_PROJECT)
    padded = sum(c.padded for c in volume.grad_chunks(10_240, layout, config))
    assert staged == (8 * padded if THIS_PROJECT.staging_copy else 0)
    off = dataclasses.replace(THIS_PROJECT, staging_copy=False)
    assert calls.staging_elements(10_240, layout, config, off) == 0
    assert calls.staging_elements(10_240, layout, config, PAPER_REFERENCE) == 0
    flat = plan_node_layout(range(8), 8)  # one node, one unpadded chunk: the bucket itself
    assert calls.staging_elements(10_240, flat, config, THIS_PROJECT) == 0
    kernels = KernelModel("gpu")  # priced at a copy's 8 bytes per element
    assert kernels.seconds("grad_stage_rows", 10**8) == pytest.approx(
        kernels.seconds("grad_requantize", 10**8) * 8 / 4.5)


def _shape(layers=4, hidden=512, untied=False):
    return ModelShape("t", layers, hidden, 8, 4 * hidden, 256, 256, 1000, untied, 2, None)


def test_tensor_parallel_and_embedding_allreduces():
    assert tp_allreduces(_shape(layers=8), 1) == 4 * 8 + 2
    assert tp_allreduces(_shape(layers=8), 2) == 4 * 4 + 1

    def run(tp, pp, intra=800.0, untied=False, nodes=2):
        cluster = Cluster(nodes, 4, tp, pp, intra, 100.0, None, NO_LATENCY)
        work = Workload(shape=_shape(untied=untied), global_batch=2 * cluster.dp, micro_batch=2,
                        tflops=10.0)
        return estimate(cluster, work, KernelModel("gpu"), ["baseline"]).variants["baseline"]
    assert run(1, 1).tp_comm_s == 0
    tp4 = run(4, 1)
    nbytes = 256 * 2 * 512 * 2  # seq x micro-batch x hidden, bf16
    assert tp4.tp_comm_s == pytest.approx((4 * 4 + 2) * 2 * 3 / 4 * nbytes * 8 / 800e9)
    assert run(4, 1, intra=1600.0).tp_comm_s == pytest.approx(tp4.tp_comm_s / 2)
    assert run(4, 1).embedding_s == 0 and run(2, 2, untied=True).embedding_s == 0
    emb = run(4, 2)  # stages on different nodes: the embedding gradient crosses the network
    assert emb.embedding_s == pytest.approx(4 * 1024 * 512 // 4 * 4 * 8 / 100e9)
    assert emb.step_s == pytest.approx(emb.compute_s + emb.tp_comm_s + emb.grad_exposed_s
                                       + emb.weight_exposed_s + emb.embedding_s)


def test_latency_adds_to_the_collectives_and_more_chunks_cost_more():
    def run(latency, cap):
        impl = dataclasses.replace(THIS_PROJECT, max_chunk_elements=cap, min_chunk_shard_elements=1)
        cluster = Cluster(4, 8, 1, 1, 1000.0, 100.0, None, latency)
        work = Workload(shape=_shape(), global_batch=64, micro_batch=2, tflops=10.0,
                        implementation=impl)
        return estimate(cluster, work, KernelModel("gpu"), ["sdp4bit"]).variants["sdp4bit"]
    none, some = run(NO_LATENCY, 1 << 22), run(Latency(10.0, 5.0, 20.0, 2.0), 1 << 22)
    assert none.grad_latency_s == 0 and some.grad_latency_s > 0
    assert some.grad_comm_s == pytest.approx(none.grad_comm_s + some.grad_latency_s)
    assert run(Latency(10.0, 5.0, 20.0, 2.0), 1 << 16).grad_latency_s > some.grad_latency_s
