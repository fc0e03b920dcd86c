"""Each bucket group draws its rounding noise from streams of its own.

Megatron starts a process's first step's bucket groups at the end of the backward
pass (dense, then expert) and later steps' groups as their gradients get ready
(expert first in an MoE model): a resumed run's first step starts them in another
order than the uninterrupted run did at that step. The noise a group receives must
therefore depend on the group, not on the order the groups are started in.
"""
from __future__ import annotations

import torch

from megatron_sdp4bit.config import preset
from megatron_sdp4bit.megatron.state import LayerState


class BucketGroup:  # what the state keys on: any object megatron keeps alive
    pass


def _noise(state, order, purpose="grads"):
    return {id(group): torch.rand(8, generator=state.generator("cpu", purpose, group)) for group in order}


def test_a_groups_noise_does_not_depend_on_the_order_the_groups_start_in(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    groups = [BucketGroup() for _ in range(3)]
    in_order, reversed_order = LayerState(config=preset("sdp4bit")), LayerState(config=preset("sdp4bit"))
    for state in (in_order, reversed_order):
        state.name_streams(groups)
    forward, backward = _noise(in_order, groups), _noise(reversed_order, groups[::-1])
    for group in groups:
        assert torch.equal(forward[id(group)], backward[id(group)])
    assert not torch.equal(forward[id(groups[0])], forward[id(groups[1])])  # streams of their own


def test_groups_are_numbered_in_construction_order_once(monkeypatch):
    state = LayerState(config=preset("sdp4bit"))
    dense, expert, next_chunk = [BucketGroup(), BucketGroup()], [BucketGroup()], [BucketGroup()]
    state.name_streams(dense + expert)
    state.name_streams(dense)  # named again (another look at the same chunk): unchanged
    state.name_streams(next_chunk)
    assert [state.stream_names[g] for g in dense + expert + next_chunk] == [
        "bucket group 0", "bucket group 1", "bucket group 2", "bucket group 3"]


def test_gradient_and_weight_streams_differ_and_nearest_rounding_draws_none(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    group = BucketGroup()
    state = LayerState(config=preset("sdp4bit"))
    state.name_streams([group])
    assert not torch.equal(_noise(state, [group])[id(group)], _noise(state, [group], "weights")[id(group)])
    assert LayerState(config=preset("sdp4bit", rounding="nearest")).generator("cpu", "grads", group) is None
