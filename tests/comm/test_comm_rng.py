"""The stochastic-rounding streams: saved and restored, on this process's device.

A checkpoint keys each stream by the device it ran on. A resume may put the rank on
another GPU (``cuda:3`` saved, ``cuda:0`` here: other launcher, fewer GPUs shared by
gloo ranks), so restoring maps the saved device to this process's device of the
same type, where the collectives will look the stream up. No GPU here: the CUDA
mapping is checked with torch.cuda's two answers replaced, the restore itself on CPU
streams.
"""
from __future__ import annotations

import torch

from megatron_sdp4bit.comm import rounding_streams
from megatron_sdp4bit.comm.rounding_streams import RoundingStreams, device_here


def test_a_cuda_stream_lands_on_the_current_gpu_whatever_its_saved_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device_here("cuda:3") == torch.device("cuda", 0)
    assert device_here("cuda") == torch.device("cuda", 0)
    assert device_here("cpu") == torch.device("cpu")


def test_a_cuda_stream_without_cuda_is_dropped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_here("cuda:1") is None
    streams = RoundingStreams()
    cpu_state = torch.Generator().manual_seed(5).get_state()
    streams.set_states({("cuda:1", 7, 0, "grads"): torch.zeros(16, dtype=torch.uint8),
                        ("cpu", 7, 0, "weights"): cpu_state})
    assert list(streams.states()) == [("cpu", 7, 0, "weights")]


def test_restored_streams_continue_where_they_were_saved():
    streams = RoundingStreams()
    gen = streams.generator_for(torch.device("cpu"), 7, 2, "grads")
    torch.rand(5, generator=gen)  # advance past the seed
    saved = streams.states()
    expected = torch.rand(8, generator=gen)
    restored = RoundingStreams()
    restored.set_states(saved)
    again = restored.generator_for(torch.device("cpu"), 7, 2, "grads")
    assert torch.equal(torch.rand(8, generator=again), expected)
    assert rounding_streams.stream_seed(7, 2, "grads") != rounding_streams.stream_seed(7, 3, "grads")


def test_streams_restored_under_another_seed_continue_the_saved_ones():
    """A run resumed with another ``--sdp4bit-seed`` looks its streams up by that seed:
    they continue the checkpoint's (as the resume's warning says), not start afresh; a
    stream saved under that seed already is kept over one re-keyed to it."""
    streams = RoundingStreams()
    gen = streams.generator_for(torch.device("cpu"), 1, 0, "grads")
    torch.rand(5, generator=gen)
    saved = streams.states()
    expected = torch.rand(8, generator=gen)
    restored = RoundingStreams()
    restored.set_states(saved, seed=5)
    assert list(restored.states()) == [("cpu", 5, 0, "grads")]
    assert torch.equal(torch.rand(8, generator=restored.generator_for(torch.device("cpu"), 5, 0, "grads")),
                       expected)
    in_use = torch.Generator().manual_seed(99)
    both = {("cpu", 5, 0, "grads"): in_use.get_state(), **saved}
    restored.set_states(both, seed=5)
    assert torch.equal(torch.rand(8, generator=restored.generator_for(torch.device("cpu"), 5, 0, "grads")),
                       torch.rand(8, generator=in_use))
