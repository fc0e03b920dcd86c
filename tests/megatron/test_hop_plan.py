"""The driver's plan lines (``megatron/hop_plan.py``): what they say for the layouts a
user meets. The lines of a real run (2 hosts, experts): ``tests/test_emulated_hosts.py``."""
from __future__ import annotations

from types import SimpleNamespace

from megatron_sdp4bit.comm.topology import Level
from megatron_sdp4bit.config import preset
from megatron_sdp4bit.megatron.hop_plan import (
    RUNNER_WORDS, describe_gather, describe_hops, describe_nodes, describe_runner)


def _topology(*levels, fallback=None):
    return SimpleNamespace(levels=tuple(Level(name, None, size) for name, size in levels),
                           fallback_reason=fallback)


def test_nodes_from_the_hosts_and_emulated_inside_them():
    assert describe_nodes(["a"] * 8 + ["b"] * 8, 8) == "2 hosts x 8 ranks (from the hosts)"
    assert describe_nodes(["a"] * 4, 2) == ("1 host x 4 ranks (from the hosts), planned as 2 nodes of 2 "
                                            "(--sdp4bit-ranks-per-node emulates nodes inside a host)")


def test_hops_name_their_bits_places_and_members():
    config = preset("sdp4bit")
    assert describe_hops(_topology(("intra", 8), ("inter", 4)), config) == \
        "8-bit inside a node (8 ranks), then 4-bit across nodes (4 ranks)"
    assert describe_hops(_topology(("inter", 2)), config) == "4-bit across nodes (2 ranks)"
    assert describe_hops(_topology(("inter", 6), fallback="DP members per node differ"), config) == \
        "4-bit across nodes (6 ranks) (one level: DP members per node differ)"
    assert describe_hops(_topology(), config) == "one rank, nothing sent"
    assert describe_hops(_topology(("intra", 4), ("inter", 2)), preset("zeropp")).startswith("4-bit inside")


def test_the_weight_gather_names_its_hops_or_its_one_all_gather():
    def layout(nodes, per_node):
        return SimpleNamespace(is_two_level=nodes > 1 and per_node > 1, num_nodes=nodes,
                               ranks_per_node=per_node, dp_size=nodes * per_node)

    config = preset("sdp4bit")
    assert describe_gather(layout(2, 4), config) == \
        "4-bit across nodes (2 ranks), then inside a node (4 ranks)"
    assert describe_gather(layout(1, 8), config) == "4-bit, one all-gather over 8 ranks"
    assert describe_gather(layout(2, 4), preset("sdp4bit", weight_gather="flat")) == \
        "4-bit, one all-gather over 8 ranks"


def test_the_runner_line_names_the_runner_and_whether_the_flag_chose_it():
    from megatron_sdp4bit.config import RUNNERS

    assert set(RUNNER_WORDS) == set(RUNNERS) - {"auto"}  # every runner a flag can name
    state = lambda kind, asked: SimpleNamespace(runner=SimpleNamespace(kind=kind),  # noqa: E731
                                                config=preset("sdp4bit", runner=asked))
    assert describe_runner(state("thread", "auto")) == "thread runner: on a worker thread"
    assert describe_runner(state("stream", "stream")) == \
        "stream runner (--sdp4bit-runner): on a CUDA side stream"
    assert describe_runner(state("inline", "inline")) == \
        "inline runner (--sdp4bit-runner): not overlapped, run when megatron starts them"
