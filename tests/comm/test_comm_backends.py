"""Backend decisions follow the backend that serves the tensors' device (``comm/backends.py``).

A ``"cpu:gloo,cuda:nccl"`` world's backend name contains "gloo", yet NCCL serves its
CUDA tensors: deciding from the name sent them down gloo's host-staged path. NCCL
cannot run on CPU, so the mixed world is seen two ways: on fake groups (the decision
alone), and in a real one-rank world ``"cpu:gloo,cuda:fake"`` (torch's test backend
standing in for NCCL on the CUDA side, through torch's own per-device lookup).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_sdp4bit.comm import backends
from megatron_sdp4bit.comm.backends import backend_for_device, backend_of, host_collective_device
from megatron_sdp4bit.comm.primitives import runs_on_host_staged_gloo


class FakeGroup:
    """A process group whose per-device backends are ``served`` ({device type: name})."""

    def __init__(self, served):
        self.served = served

    def _get_backend(self, device):
        if device.type not in self.served:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        name = self.served[device.type]

        class Backend:
            def name(self):
                return name
        return Backend()


@pytest.mark.parametrize("name,device,expected", [
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
    ("gloo", "cuda", "gloo"), ("gloo", "cpu", "gloo"), ("nccl", "cpu", None), ("nccl", "cuda", "nccl"),
    ("cpu:gloo", "cuda", None), ("MPI", "cpu", "mpi"),
])
def test_the_backend_a_name_gives_each_device(name, device, expected):
    assert backend_for_device(name, device) == expected


def test_a_mixed_world_runs_cuda_tensors_on_its_cuda_backend():
    mixed = FakeGroup({"cpu": "gloo", "cuda": "nccl"})
    assert backend_of(mixed, torch.device("cuda", 1)) == "nccl" and backend_of(mixed, "cpu") == "gloo"
    assert not runs_on_host_staged_gloo(mixed, torch.device("cuda", 0))
    assert runs_on_host_staged_gloo(FakeGroup({"cpu": "gloo", "cuda": "gloo"}), "cuda")
    assert not runs_on_host_staged_gloo(FakeGroup({"cpu": "gloo", "cuda": "gloo"}), "cpu")
    assert host_collective_device(mixed) == torch.device("cpu")


def test_without_the_per_device_lookup_the_name_is_read_per_device(monkeypatch):
    monkeypatch.setattr(backends.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert backend_of(object(), "cuda") == "nccl"
    assert not runs_on_host_staged_gloo(object(), "cuda")


@pytest.fixture
def mixed_world(tmp_path):
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")  # registers the "fake" backend
    dist.init_process_group("cpu:gloo,cuda:fake", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_real_mixed_world_decides_per_device(mixed_world):
    assert "gloo" in dist.get_backend()  # what the name-based decision read
    for group in (None, dist.group.WORLD, dist.new_group([0])):
        assert backend_of(group, "cuda") == "fake" and backend_of(group, "cpu") == "gloo"
        assert not runs_on_host_staged_gloo(group, torch.device("cuda", 0))
        assert host_collective_device(group) == torch.device("cpu")
