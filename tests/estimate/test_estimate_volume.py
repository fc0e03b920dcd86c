"""The estimator's byte counts against what the real collectives record, and link volumes."""
from __future__ import annotations

import pytest
import torch

from estimate_cases import CONFIGS, cases, measure
from harness import spawn_ranks
from megatron_sdp4bit.comm.layout import plan_node_layout
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.estimate import volume
from megatron_sdp4bit.estimate.implementation import PAPER_REFERENCE

WORLD = 4


@pytest.fixture(scope="module")
def recorded():
    """The accounting of every case, from 4 real gloo ranks (one world for all cases)."""
    return spawn_ranks(measure, WORLD, timeout_s=240, start="forkserver")


def test_sent_bytes_equal_the_accounting_of_real_collectives(recorded):
    mismatches = []
    for name, rpn, shard, dtype in cases():
        layout = plan_node_layout(range(WORLD), rpn)
        base, overrides = CONFIGS[name]
        config = preset(base, ranks_per_node=rpn, **overrides)
        elt = torch.empty(0, dtype=dtype).element_size()
        for rank in range(WORLD):
            rs = volume.reduce_scatter_sent(shard, elt, layout, rank, config)
            ag = volume.all_gather_sent(shard, elt, layout, rank, config)
            ours = {("reduce_scatter", "intra"): (rs.intra, rs.exact_intra),
                    ("reduce_scatter", "inter"): (rs.inter, rs.exact_inter),
                    ("all_gather", "intra"): (ag.intra, ag.exact_intra),
                    ("all_gather", "inter"): (ag.inter, ag.exact_inter)}
            real = recorded[rank][(name, rpn, shard, str(dtype))]
            if ours != real:
                mismatches.append((name, rpn, shard, str(dtype), rank, ours, real))
    assert not mismatches, mismatches[:3]


def test_quantized_all_to_all_hops_send_what_they_account():
    """Direct sends: the link bytes of each hop are the accounted bytes, rank by rank."""
    layout = plan_node_layout(range(8), 4)  # 2 nodes x 4
    config = preset("sdp4bit")
    shard = 10_000
    links = volume.reduce_scatter_links(shard, 4, layout, config, "ring")
    assert [d for d, _ in links.phases] == ["intra all-to-all", "inter all-to-all"]
    intra, inter = (lk for _, lk in links.phases)
    for rank in range(8):
        sent = volume.reduce_scatter_sent(shard, 4, layout, rank, config)
        assert intra.gpu_intra[rank] == sent.intra and sent.inter
    assert inter.node_inter == {0: 4 * sent.inter, 1: 4 * sent.inter}


def test_ring_volumes_of_the_exact_collectives():
    """A ring crosses each node boundary once: (P - 1) chunks per node, per ring."""
    layout = plan_node_layout(range(8), 4)
    config = preset("baseline")
    shard = 1000
    ring = volume.reduce_scatter_links(shard, 4, layout, config, "ring").phases[0][1]
    assert ring.node_inter == {0: 7 * shard * 4, 1: 7 * shard * 4}
    assert ring.gpu_intra[0] == 7 * shard * 4 and 3 not in ring.gpu_intra  # 3 -> 4 leaves node 0
    allreduce = volume.reduce_scatter_links(shard, 4, layout, config, "allreduce").phases[0][1]
    assert allreduce.node_inter == {n: 2 * b for n, b in ring.node_inter.items()}
    a2a = volume.reduce_scatter_links(shard, 4, layout, config, "alltoall").phases[0][1]
    assert a2a.node_inter == {0: 4 * 4 * shard * 4, 1: 4 * 4 * shard * 4}  # 4 ranks x 4 remote peers
    gather = volume.all_gather_links(shard, 2, layout, preset("sdp4bit"), PAPER_REFERENCE)
    chunk = volume.all_gather_chunk(shard, 2, preset("sdp4bit"), 8)  # one group of 2048, padded
    # one segment: 1024 bytes of codes, then one fp32 scale, padded to 16 bytes
    assert chunk == 2048 // 2 + 16 and gather.phases[0][1].node_inter == {0: 7 * chunk, 1: 7 * chunk}


def test_two_level_gathers_carry_one_node_share_across_nodes():
    """This project's quantized gather on 2 nodes x 4 (comm/gather_hops.py): each rank's
    segment crosses to its counterpart once (4 segments a node, not a ring's 7), then
    each node's 2 segments go round the node; and what the ranks account is that."""
    layout = plan_node_layout(range(8), 4)
    config, shard = preset("sdp4bit"), 1000
    chunk = volume.all_gather_chunk(shard, 2, config, 8)
    (across_name, across), (inside_name, inside) = volume.all_gather_links(
        shard, 2, layout, config).phases
    assert across.node_inter == {0: 4 * chunk, 1: 4 * chunk} and not across.gpu_intra
    assert inside.gpu_intra == {rank: 3 * 2 * chunk for rank in range(8)} and not inside.node_inter
    sent = volume.all_gather_sent(shard, 2, layout, 0, config)
    assert (sent.inter, sent.intra) == (chunk, 3 * 2 * chunk)
    flat = volume.all_gather_sent(shard, 2, layout, 0, config, PAPER_REFERENCE)
    assert (flat.inter, flat.intra) == (4 * chunk, 3 * chunk)
    asked_flat = preset("sdp4bit", weight_gather="flat")
    assert volume.all_gather_sent(shard, 2, layout, 0, asked_flat) == flat
    assert [name for name, _ in volume.all_gather_links(shard, 2, layout, asked_flat).phases] == [
        "ring all-gather"]
    assert sent.exact_inter == flat.exact_inter  # the exact gather it replaces is the same


def test_megatron_dp_groups_follow_tp_dp_pp_order():
    groups = volume.megatron_dp_groups(16, tp=2, pp=2)
    assert groups[0] == (0, [0, 2, 4, 6]) and groups[1] == (0, [1, 3, 5, 7])
    assert groups[2] == (1, [8, 10, 12, 14])
    layouts = volume.dp_layouts(4, 4, tp=2, pp=2)  # 4 nodes of 4: DP 4 over 2 nodes, 2 per node
    assert all(lay.is_two_level and lay.members_per_node == 2 for _, lay in layouts)
