"""The estimator on the runner for one hardware queue (``--runner deferred``): its chunks and
calls are the real ``DeferringRunner``'s, its schedule hides each hop behind one bucket's
pass and no more, its kernels stay in the step, its memory is the layer's."""
from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest

from estimate_cases import CALL_CASES, FLOORS, ONE_QUEUE_LIMITS, count_calls
from harness import spawn_ranks
from megatron_sdp4bit.comm.layout import ONE_QUEUE_WHOLE_BUCKET_ELEMENTS, plan_node_layout
from megatron_sdp4bit.comm.memory_plan import layer_memory
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.estimate import calls, cli, one_queue, overlap, timing, volume
from megatron_sdp4bit.estimate.gpt_shape import load_model_shape
from megatron_sdp4bit.estimate.implementation import PAPER_REFERENCE, THIS_PROJECT
from megatron_sdp4bit.estimate.kernels import KernelModel
from megatron_sdp4bit.estimate.timing import Cluster, EstimateError, Workload, estimate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 4


@pytest.fixture(scope="module")
def deferred_calls():
    return spawn_ranks(count_calls, WORLD, ONE_QUEUE_LIMITS, timeout_s=240,
                       start="forkserver")[0]


def test_whole_buckets_and_chunks_are_the_deferring_runners_calls(deferred_calls):
    """Under a limit above the bucket the runner's collectives make one chunk and one
    slice whatever the cap; under one below it, the cap's chunks. The estimator's counts
    are the real calls divided by one constant per collective (calls per hop, per slice)."""
    per_hop, per_slice = set(), set()
    for (rpn, shard, cap), limit in ((c, lim) for c in CALL_CASES for lim in ONE_QUEUE_LIMITS):
        layout = plan_node_layout(range(WORLD), rpn)
        config = preset("sdp4bit", ranks_per_node=rpn)
        impl = dataclasses.replace(THIS_PROJECT, max_chunk_elements=cap, messages_per_peer=1,
                                   min_chunk_shard_elements=FLOORS[0],
                                   min_slice_elements=FLOORS[1], whole_bucket_elements=limit)
        model = calls.reduce_scatter_calls(shard, layout, config, "ring", impl)
        slices = calls.weight_slices(shard, layout, config, impl)
        a2a, ag = deferred_calls[(rpn, shard, cap, limit)]
        assert a2a % model.calls == 0 and ag % slices == 0, (rpn, shard, cap, limit, a2a, ag)
        per_hop.add(a2a // model.calls)
        per_slice.add(ag // slices)
        whole = WORLD * shard <= limit
        chunks = len(volume.grad_chunks(shard, layout, config, impl))
        assert (chunks == 1 and slices == 1) if whole else True
        if (rpn, shard, cap) == (2, 4101, 4096):  # the cases exercise both sides
            assert (chunks, slices) == ((1, 1) if whole else (5, 3))
    assert len(per_hop) == 1 and len(per_slice) == 1


def test_one_level_hides_every_bucket_but_the_last_while_hops_fit_the_pass():
    """Each hop is issued at its bucket's start and waited for one bucket later: while a
    bucket's hop takes less than a bucket's pass, only the last bucket's hop stays out,
    as on the stream runner."""
    for buckets in (1, 2, 4, 8):
        shares = [1 / buckets] * buckets
        assert one_queue.reduce_scatter_exposed([0.5], 1.0, shares) == \
            pytest.approx(0.5 / buckets)


def test_two_levels_expose_the_last_bucket_and_the_one_before_its_second_hop():
    """The pass ends at the last bucket's start, which issues the bucket before it's second
    hop and the last bucket's first: with equal buckets whose hops h1, h2 fit a bucket's
    pass, max(h1, h2) + h2 stays out (the last second hop after both); earlier hops hide."""
    for buckets in (2, 4, 8):
        shares = [1 / buckets] * buckets
        for hops in ([0.3, 0.6], [0.6, 0.3]):
            h1, h2 = (h / buckets for h in hops)
            got = one_queue.reduce_scatter_exposed(hops, 1.0, shares)
            assert got == pytest.approx(max(h1, h2) + h2), (buckets, hops)


def test_a_hop_longer_than_a_buckets_pass_stalls_the_pass_by_the_excess():
    """A wait for a hop still in flight holds the queue: with equal buckets whose hop h
    outlasts a bucket's pass b, every bucket after the first waits h - b, then the last
    hop: the stream runner's queue gives the same (it exposes the excess at the end)."""
    buckets, comm = 4, 3.0
    shares = [1 / buckets] * buckets
    closed = max(comm / buckets, comm - 1.0 * (buckets - 1) / buckets)
    assert one_queue.reduce_scatter_exposed([comm], 1.0, shares) == pytest.approx(closed)
    assert overlap.chain_reduce_scatter_exposed(comm, 1.0, shares) == pytest.approx(closed)
    # unequal buckets: the stream runner's queue lends a short bucket's slack to the next
    # one; one queue stops the pass at each wait, and that slack is lost
    assert one_queue.reduce_scatter_exposed([3.0], 1.0, [0.3, 0.1, 0.6]) == pytest.approx(2.6)
    assert overlap.chain_reduce_scatter_exposed(3.0, 1.0, [0.3, 0.1, 0.6]) == pytest.approx(2.3)


def test_stages_at_later_calls_never_hide_more_than_issuing_them_at_once():
    """One level, random buckets: the deferring runner issues each hop at or after the
    time the stream runner would and waits for it no later than the pass needs it, so it
    exposes at least as much; its gathers, started one bucket ahead instead of all at the
    step, too."""
    rng = random.Random(7)
    for _ in range(300):
        raw = [rng.uniform(0.05, 1.0) for _ in range(rng.randint(1, 9))]
        shares = [r / sum(raw) for r in raw]
        comm, window = rng.uniform(0.01, 3.0), rng.uniform(0.1, 2.0)
        assert (one_queue.reduce_scatter_exposed([comm], window, shares)
                >= overlap.chain_reduce_scatter_exposed(comm, window, shares) - 1e-12)
        assert (one_queue.gather_exposed([comm], window, shares)
                >= overlap.chain_gather_exposed(comm, window, shares) - 1e-12)


def test_gathers_hide_only_their_first_hop_behind_one_buckets_forward():
    """Megatron starts bucket k + 1's gather at bucket k's pre-hook: its first hop runs
    beside bucket k's forward; the pre-hook's wait issues the second hop and waits for
    it. So the first bucket's gather and every bucket's second hop stay out; a first hop
    longer than a bucket's forward adds its excess."""
    shares = [0.25] * 4
    assert one_queue.gather_exposed([0.4], 1.0, shares) == pytest.approx(0.1)
    assert one_queue.gather_exposed([0.4, 0.2], 1.0, shares) == pytest.approx(0.1 + 0.2)
    # first hops of 0.5 per bucket against 0.25 of forward: 0.25 more at each later bucket
    assert one_queue.gather_exposed([2.0], 1.0, shares) == pytest.approx(0.5 + 3 * 0.25)
    # the forward pass takes megatron's last bucket first
    assert one_queue.gather_exposed([1.0], 100.0, [0.2, 0.2, 0.2, 0.4]) == \
        pytest.approx(0.4)


def _estimate(runner: str, overlap: str = "full", implementation=THIS_PROJECT, tp: int = 4):
    shape = load_model_shape(os.path.join(REPO, "configs", "gpt_6.7b.yaml"))
    return estimate(Cluster(4, 8, tp, 1, 1600.0, 100.0),
                    Workload(shape=shape, global_batch=64, micro_batch=1, tflops=150.0,
                             overlap=overlap, runner=runner, implementation=implementation),
                    KernelModel("gpu"))


def test_the_step_keeps_the_kernels_and_takes_buckets_whole():
    stream, deferred = _estimate("stream"), _estimate("deferred")
    assert deferred.buckets == stream.buckets
    assert all(n <= ONE_QUEUE_WHOLE_BUCKET_ELEMENTS for n in deferred.buckets[0])
    for name in ("sdp4bit", "zeropp"):
        s, d = stream.variants[name], deferred.variants[name]
        assert d.kernel_ops == pytest.approx(s.kernel_ops)
        assert d.kernel_s == pytest.approx(sum(d.kernel_ops.values()))  # in the step
        assert s.kernel_s == pytest.approx(0.0)  # in the side stream's chain
        assert d.grad_latency_s < s.grad_latency_s  # one chunk per bucket: fewer calls
        assert d.weight_latency_s < s.weight_latency_s  # one slice per bucket
        # the same bytes, but for one chunk's padding and scales instead of several
        assert d.sent.total == pytest.approx(s.sent.total, rel=1e-4)
    base_s, base_d = stream.variants["baseline"], deferred.variants["baseline"]
    assert base_d.step_s == pytest.approx(base_s.step_s)  # megatron's own collectives


def test_the_step_prices_the_runners_own_schedule():
    """A long pass (one micro-batch, 10 s) on a 20 Gbit/s link: on the stream runner only the
    last bucket's reduce-scatter and the first gather stay out; on one queue also the
    second hop of the bucket before the last and every gather's hop inside the node."""
    shape = load_model_shape(os.path.join(REPO, "configs", "gpt_6.7b.yaml"))

    def run(runner):
        return estimate(Cluster(4, 8, 4, 1, 1600.0, 20.0),
                        Workload(shape=shape, global_batch=8, micro_batch=1, compute_s=10.0,
                                 overlap="full", runner=runner),
                        KernelModel("gpu")).variants["sdp4bit"]
    stream, deferred = run("stream"), run("deferred")
    assert deferred.grad_exposed_s > 1.3 * stream.grad_exposed_s
    assert deferred.weight_exposed_s > stream.weight_exposed_s
    assert deferred.grad_exposed_s < 0.1 * deferred.grad_comm_s  # the rest hides


def test_memory_is_the_layers_on_that_runner():
    stream, deferred = _estimate("stream"), _estimate("deferred")
    for name in ("sdp4bit", "zeropp"):
        s, d = stream.variants[name].memory, deferred.variants[name].memory
        layout = volume.dp_layouts(4, 8, 4, 1)[0][1]  # DP 8: 4 nodes x 2 ranks
        assert layout.is_two_level
        counted = layer_memory(deferred.buckets[0], layout.dp_size, deferred.variants[name].config,
                               params=d.params, node_members=len(layout.nodes[0]),
                               fp32_params=False,
                               whole_bucket_elements=ONE_QUEUE_WHOLE_BUCKET_ELEMENTS)
        assert d == counted
        assert d.buffer_bytes > s.buffer_bytes  # a whole bucket's buffers, not two chunks'


def test_without_overlap_there_is_no_runner():
    stream, deferred = _estimate("stream", overlap="none"), _estimate("deferred", overlap="none")
    for name in stream.variants:
        assert deferred.variants[name].step_s == stream.variants[name].step_s
        assert deferred.variants[name].memory == stream.variants[name].memory


def test_the_papers_code_has_no_such_runner():
    with pytest.raises(EstimateError) as info:
        _estimate("deferred", implementation=PAPER_REFERENCE)
    assert info.value.flag == "--runner"
    _estimate("deferred", overlap="none", implementation=PAPER_REFERENCE)  # nothing to run


def test_auto_takes_one_queue_under_tensor_parallelism(capsys):
    argv = ["--config", os.path.join(REPO, "configs", "gpt_6.7b.yaml"), "--cluster-type",
            "h800-ib", "--nodes", "4", "--overlap", "full", "--json"]
    for extra, expected in (([], "deferred"), (["--tp", "1"], "stream"),
                            (["--runner", "stream"], "stream"),
                            (["--tp", "1", "--runner", "deferred"], "deferred")):
        assert cli.main(argv + extra) == 0
        assert json.loads(capsys.readouterr().out)["runner"] == expected, extra
    assert cli.main(argv[:-1]) == 0
    assert "one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1" in capsys.readouterr().out
    assert cli.main(argv + ["--runner", "deferred", "--implementation", "paper-reference"]) == 2
    assert "--runner" in capsys.readouterr().err
    assert cli.RUNNERS == timing.RUNNERS
    no_overlap = [a for a in argv if a not in ("--overlap", "full")]
    for extra in ([], ["--runner", "deferred", "--implementation", "paper-reference"]):
        assert cli.main(no_overlap + extra) == 0  # no overlap: no runner runs
        assert json.loads(capsys.readouterr().out)["runner"] is None, extra


def test_buckets_above_the_limit_are_named(capsys):
    """At DP 128 megatron's buckets (1 M x DP elements) exceed 64 M: the runner keeps them
    in chunks that wait inside one call; the output says how many."""
    argv = ["--config", os.path.join(REPO, "configs", "gpt_6.7b.yaml"), "--cluster-type",
            "h800-ib", "--overlap", "full", "--runner", "deferred"]
    for nodes, tp, chunked in (("16", "1", True), ("4", "4", False)):
        assert cli.main(argv + ["--nodes", nodes, "--tp", tp, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        limit = ONE_QUEUE_WHOLE_BUCKET_ELEMENTS
        assert data["one_queue_chunked_buckets"] == sum(n > limit for n in data["buckets"]["0"])
        assert (data["one_queue_chunked_buckets"] > 0) == chunked
        assert cli.main(argv + ["--nodes", nodes, "--tp", tp]) == 0
        assert ("above 64 M elements, which the runner keeps in chunks"
                in capsys.readouterr().out) == chunked


def test_a_chunked_buckets_body_waits_for_its_chunks_in_the_call():
    """A bucket of K chunks starts chunk 0 at its own start; at the next bucket's start its
    body runs the other K - 1, each waited for in the call: with two buckets of one hop H
    each and a long pass, the first bucket's K - 1 chunks stall the pass before the last
    bucket starts, and the last bucket's whole hop follows: (K - 1) H / K + H."""
    for k in (1, 2, 4):
        assert one_queue.reduce_scatter_exposed([2.0], 100.0, [0.5, 0.5], [k, k]) == \
            pytest.approx(1.0 + (k - 1) / k)
        # the gathers alike: the first bucket needed whole, the next one's slices but the first
        assert one_queue.gather_exposed([2.0], 100.0, [0.5, 0.5], [k, k]) == \
            pytest.approx(1.0 + (k - 1) / k)


def test_two_levels_pipeline_a_buckets_chunks_over_the_two_links():
    """One bucket of 2 chunks, two levels (hops h1, h2), at the pass's end: chunk 0's
    first hop at the start; the wait then runs chunk 1's first hop beside chunk 0's
    second, waits for chunk 1's first, starts its second after chunk 0's, and waits:
    max(h1, (h1 + h2) / 2) + h2 / 2 (comm/gradients.py's launch_rest and complete)."""
    for h1, h2 in ((1.0, 2.0), (2.0, 1.0), (1.0, 1.0)):
        got = one_queue.reduce_scatter_exposed([h1, h2], 10.0, [1.0], [2])
        assert got == pytest.approx(max(h1, (h1 + h2) / 2) + h2 / 2), (h1, h2)


def test_one_level_chunks_never_hide_more_than_a_whole_bucket():
    """One hop level: a bucket's chunks after the first are issued a call later than a
    whole bucket's hop and waited for at the same call, so they never expose less. (With
    two levels a chunk's first hop runs beside the previous chunk's second, on the other
    link, and chunks may expose less.)"""
    rng = random.Random(11)
    for _ in range(200):
        count = rng.randint(1, 6)
        raw = [rng.uniform(0.05, 1.0) for _ in range(count)]
        shares = [r / sum(raw) for r in raw]
        hops = [rng.uniform(0.01, 2.0)]
        window = rng.uniform(0.1, 3.0)
        chunks = [rng.randint(1, 5) for _ in range(count)]
        for exposed in (one_queue.reduce_scatter_exposed, one_queue.gather_exposed):
            assert exposed(hops, window, shares, chunks) >= exposed(hops, window, shares) - 1e-12
