"""Wire counters and random streams (pure, no processes)."""
from __future__ import annotations

import pytest
import torch

from megatron_sdp4bit.comm import get_wire_stats, reset_wire_stats
from megatron_sdp4bit.comm.accounting import DEFAULT_RECORDER, WireRecorder
from megatron_sdp4bit.comm.rounding_streams import generator_for, reset_generators, stream_seed


def test_counters_sum_per_level_and_kind_and_reset():
    reset_wire_stats()
    DEFAULT_RECORDER.call("reduce_scatter")
    DEFAULT_RECORDER.peer_sends("reduce_scatter", 1, 2, codes=100, scales=4, elements=200, exact=800)
    DEFAULT_RECORDER.peer_sends("all_gather", 3, 0, values=10, elements=5, exact=10)
    stats = get_wire_stats()
    assert stats.sent_bytes("reduce_scatter", "intra") == 104
    assert stats.sent_bytes("reduce_scatter", "inter", "codes") == 200
    assert stats.sent_bytes("reduce_scatter") == 312
    assert stats.exact_bytes("reduce_scatter", "inter") == 1600
    assert stats.bits_per_element("reduce_scatter", "inter") == pytest.approx(8 * 208 / 400)
    assert stats.saving("reduce_scatter") == pytest.approx(2400 / 312)
    assert stats.sent_bytes("all_gather", kind="values") == 30
    assert stats.as_dict()["calls"] == {"all_gather": 0, "reduce_scatter": 1}
    assert "reduce_scatter  inter" in stats.format()
    reset_wire_stats()
    assert get_wire_stats().sent_bytes() == 0 and stats.sent_bytes() == 342  # a snapshot


def test_a_recorder_counts_apart_from_the_default():
    # The installed layer passes its own recorder to every collective: a run's figures
    # are its layer's alone, whatever else in the process calls the collectives.
    reset_wire_stats()
    mine = WireRecorder()
    mine.call("all_gather")
    mine.peer_sends("all_gather", 1, 1, codes=8, exact=32)
    assert mine.snapshot().sent_bytes() == 16 and mine.snapshot().exact_bytes() == 64
    assert get_wire_stats().sent_bytes() == 0 and get_wire_stats().calls == {}
    mine.reset()
    assert mine.snapshot().counters == {}


def test_unknown_counters_are_rejected():
    with pytest.raises(ValueError):
        WireRecorder().peer_sends("broadcast", 1, 0, codes=1)
    with pytest.raises(ValueError):
        WireRecorder().peer_sends("all_gather", 1, 0, bytes=1)


def test_streams_differ_per_rank_purpose_and_seed():
    seeds = {stream_seed(s, r, p) for s in (1, 2) for r in range(64) for p in ("grads", "weights")}
    assert len(seeds) == 2 * 64 * 2


def test_generators_are_cached_and_restart_after_reset():
    reset_generators()
    first = torch.rand(4, generator=generator_for("cpu", 1, 0, "grads"))
    second = torch.rand(4, generator=generator_for("cpu", 1, 0, "grads"))
    assert not torch.equal(first, second)  # the stream advances between calls
    other_rank = torch.rand(4, generator=generator_for("cpu", 1, 1, "grads"))
    assert not torch.equal(first, other_rank)
    reset_generators()
    assert torch.equal(first, torch.rand(4, generator=generator_for("cpu", 1, 0, "grads")))
