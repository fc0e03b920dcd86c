"""The checkpoint's CUDA RNG state is this rank's device's only, on emulated GPUs.

torch.cuda's RNG functions are replaced by a fake node of N GPUs, each with its
own state, so that the save and the restore are seen on CPU: a save stores the
current device's state as one tensor; a resume that sees fewer GPUs, or another
rank-to-GPU mapping, restores the stream this rank saved; an older checkpoint
holding every GPU's state gives the current device's entry, or a one-line error
when it has none.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sdp4bit.training.checkpoint import CheckpointError, rng_state, set_rng_state


class FakeNode:
    """``visible`` GPUs, each with a distinct RNG state; ``current`` is this rank's."""

    def __init__(self, visible: int, current: int):
        self.states = [torch.full((8,), 10 + d, dtype=torch.uint8) for d in range(visible)]
        self.current = current

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.set_rng_state_all)

    def _index(self, device) -> int:
        index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
        index = self.current if index is None else index
        if index >= len(self.states):
            raise IndexError(f"GPU {index} of {len(self.states)}")
        return index

    def get_rng_state(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set_rng_state(self, new_state, device="cuda"):
        self.states[self._index(device)] = new_state.clone()

    def set_rng_state_all(self, new_states):
        for device, new_state in enumerate(new_states):
            self.set_rng_state(new_state, device)


def test_save_holds_this_devices_state_only(monkeypatch):
    FakeNode(visible=4, current=2).install(monkeypatch)
    saved = rng_state()["cuda"]
    assert isinstance(saved, torch.Tensor) and saved.tolist() == [12] * 8


@pytest.mark.parametrize("visible,current", [(1, 0), (4, 3)], ids=["fewer-gpus", "other-mapping"])
def test_resume_restores_the_saved_stream_on_this_rank_device(monkeypatch, visible, current):
    FakeNode(visible=4, current=2).install(monkeypatch)
    state = rng_state()
    resumed = FakeNode(visible=visible, current=current)
    resumed.install(monkeypatch)
    set_rng_state(state)
    assert resumed.states[current].tolist() == [12] * 8
    assert all(s.tolist() == [10 + d] * 8 for d, s in enumerate(resumed.states) if d != current)


def test_older_checkpoint_with_every_gpu_gives_this_devices_entry(monkeypatch):
    FakeNode(visible=4, current=1).install(monkeypatch)
    state = rng_state()
    state["cuda"] = [torch.full((8,), 20 + d, dtype=torch.uint8) for d in range(4)]
    node = FakeNode(visible=4, current=1)
    node.install(monkeypatch)
    set_rng_state(state)
    assert [s[0].item() for s in node.states] == [10, 21, 12, 13]


def test_older_checkpoint_without_this_devices_entry_is_refused_in_one_line(monkeypatch):
    FakeNode(visible=4, current=3).install(monkeypatch)
    state = rng_state()
    state["cuda"] = [torch.zeros(8, dtype=torch.uint8)] * 2
    with pytest.raises(CheckpointError, match=r"^the checkpoint holds the CUDA RNG states of 2 GPUs .* GPU 3: [^\n]*$"):
        set_rng_state(state)
