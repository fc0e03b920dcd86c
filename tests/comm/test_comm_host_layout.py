"""The pure rules of the hosts' own layout (``comm/host_layout.py``): no ranks needed."""
from __future__ import annotations

import pytest

from megatron_sdp4bit.comm.host_layout import (
    host_blocks,
    parse_local_world_size,
    ranks_per_host,
    resolve_ranks_per_node,
)

TWO_BY_TWO = ("a", "a", "b", "b")


@pytest.mark.parametrize("hosts, per_host", [
    (("a",), 1), (("a",) * 4, 4), (TWO_BY_TWO, 2), (("a", "b", "c", "d"), 1),
    (("a",) * 8 + ("b",) * 8 + ("c",) * 8, 8),
])
def test_equal_runs_of_consecutive_ranks_give_the_ranks_per_host(hosts, per_host):
    assert ranks_per_host(hosts) == per_host


def test_runs_are_found_in_rank_order():
    assert host_blocks(("a", "a", "b", "a")) == [("a", [0, 1]), ("b", [2]), ("a", [3])]


@pytest.mark.parametrize("hosts, line", [
    (("a",) * 3 + ("b",) * 5, "hosts hold unequal numbers of ranks (ranks 0-2 on 'a', ranks 3-7 on 'b')"),
    (("a", "a", "a", "b"), "hosts hold unequal numbers of ranks (ranks 0-2 on 'a', ranks 3 on 'b')"),
    (("a", "b", "a", "b"), "host 'a' holds ranks 0 and 2, not one run of consecutive ranks"),
    (("a", "a", "b", "b", "a", "a"), "host 'a' holds ranks 0-1 and 4-5"),
])
def test_uneven_or_interleaved_hosts_are_refused_in_one_line(hosts, line):
    with pytest.raises(ValueError) as refused:
        ranks_per_host(hosts)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


@pytest.mark.parametrize("hosts, local, flag, expected", [
    (TWO_BY_TWO, None, None, (2, None)),
    (TWO_BY_TWO, 2, None, (2, None)),
    (TWO_BY_TWO, 2, 2, (2, None)),
    (("a",) * 4, None, None, (4, None)),
    (("a",) * 4, 4, 1, (1, "--sdp4bit-ranks-per-node 1 emulates 4 nodes inside each of the 1 host(s) "
                           "of 4 ranks (for tests and benchmarks)")),
    (("a",) * 4, None, 2, (2, "--sdp4bit-ranks-per-node 2 emulates 2 nodes inside each of the 1 host(s) "
                              "of 4 ranks (for tests and benchmarks)")),
])
def test_the_launcher_and_the_flag_cross_check_the_hosts(hosts, local, flag, expected):
    assert resolve_ranks_per_node(hosts, local, flag) == expected


@pytest.mark.parametrize("hosts, local, flag, line", [
    (TWO_BY_TWO, 4, None, "LOCAL_WORLD_SIZE=4 but the hosts hold 2 ranks each (2 host(s), 4 ranks)"),
    (("a",) * 4, 2, None, "LOCAL_WORLD_SIZE=2 but the hosts hold 4 ranks each (1 host(s), 4 ranks)"),
    (TWO_BY_TWO, None, 4, "--sdp4bit-ranks-per-node 4 (ranks_per_node) neither equals nor divides the 2 "
                          "ranks on each of the 2 host(s) (4 ranks)"),
    (("a",) * 6, None, 4, "--sdp4bit-ranks-per-node 4 (ranks_per_node) neither equals nor divides the 6"),
])
def test_a_disagreeing_launcher_or_flag_is_refused_in_one_line(hosts, local, flag, line):
    with pytest.raises(ValueError) as refused:
        resolve_ranks_per_node(hosts, local, flag)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


@pytest.mark.parametrize("value, parsed", [(None, None), ("", None), ("8", 8)])
def test_local_world_size_is_read_when_set(value, parsed):
    assert parse_local_world_size(value) == parsed


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_bad_local_world_size_is_named(value):
    with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE={value!r} is not a positive integer"):
        parse_local_world_size(value)
