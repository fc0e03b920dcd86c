"""The layer's own exact bucket collectives: what runs on gloo with CUDA tensors.

With ``--distributed-backend gloo`` on a GPU machine (several data-parallel ranks on
one GPU) megatron's coalesced bucket collectives cannot run on CUDA tensors (torch's
gloo stages them through host memory only for single all-gathers, all-to-alls,
all-reduces and broadcasts), so the layer issues the exact reduce-scatter and
all-gather itself, per bucket (``LayerState.own_exact_collectives``). No GPU here:
these tests turn that path on for CPU tensors over gloo and check it against stock
megatron, which is what it replaces:

- exact collectives: the same losses as megatron's own to fp32 rounding (the
  reduce-scatter sums in another order), replicas bit-identical, and megatron's own
  bucket collectives never called;
- with SDP4Bit (qWD + TLq-HS, exact gradients for the first 2 steps, overlap on and
  off): trains like the stock exact run, replicas bit-identical every step.

The decision itself (gloo + a CUDA device) is checked on a real gloo group with a
CUDA ``torch.device``, which needs no GPU to exist.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sdp4bit.config import preset
from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec

WORLD = 4
STEPS = 8
SPECS = {
    "bf16": TinyGPTSpec(dtype="bf16"),
    "fp32-overlap-both": TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True,
                                     overlap_param_gather=True, bucket_size=4000),
}


def _counting(calls: dict, key: str, function):
    def counted(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return function(*args, **kwargs)
    return counted


def _train(spec: TinyGPTSpec, config, own_exact: bool):
    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit.megatron import patch

    patch.uninstall()
    calls: dict = {}
    originals = {}
    if config is not None:
        layer = patch.install(config)
        layer.state.own_exact_collectives = own_exact
        originals = dict(layer._originals)  # restored below: uninstall puts these back
        for key in (("bucket_group", "start_grad_sync"), ("bucket_group", "start_param_sync")):
            layer._originals[key] = _counting(calls, key[1], originals[key])
    records = TinyGPTTrainer(spec).train_steps(STEPS)
    if config is not None:
        layer._originals = originals
    patch.uninstall()
    return {"losses": [r.loss for r in records], "hashes": [r.weights_sha256 for r in records],
            "megatron_calls": calls}


def _world(rank, world_size):
    from megatron_sdp4bit.comm.primitives import runs_on_host_staged_gloo

    group = torch.distributed.group.WORLD
    decision = (runs_on_host_staged_gloo(group, torch.device("cuda", 0)),
                runs_on_host_staged_gloo(group, "cpu"))
    exact = preset("baseline", ranks_per_node=2)
    sdp = preset("sdp4bit", ranks_per_node=2, grad_start_iter=2)
    runs = {}
    for name, spec in SPECS.items():
        runs[name] = {
            "stock": _train(spec, None, False),
            "exact-own": _train(spec, exact, True),
            "sdp4bit-own": _train(spec, sdp, True),
        }
    return decision, runs


@pytest.fixture(scope="module")
def runs():
    return spawn_ranks(_world, WORLD, timeout_s=900)


def test_gloo_with_a_cuda_device_takes_the_layers_own_path(runs):
    for decision, _ in runs:
        assert decision == (True, False)


@pytest.mark.parametrize("name", list(SPECS))
def test_own_exact_collectives_match_megatrons(runs, name):
    for _, per_name in runs:
        stock, own = per_name[name]["stock"], per_name[name]["exact-own"]
        assert own["losses"] == pytest.approx(stock["losses"], rel=1e-5)
        assert own["megatron_calls"] == {}, "megatron's own bucket collectives ran"
    for step in range(STEPS):
        assert len({r[name]["exact-own"]["hashes"][step] for _, r in runs}) == 1


@pytest.mark.parametrize("name", list(SPECS))
def test_sdp4bit_on_the_own_exact_path_trains_with_identical_replicas(runs, name):
    for _, per_name in runs:
        stock, sdp = per_name[name]["stock"], per_name[name]["sdp4bit-own"]
        assert sdp["megatron_calls"] == {}
        assert sdp["losses"][0] == pytest.approx(stock["losses"][0], rel=1e-6)  # before any update
        assert abs(sdp["losses"][-1] - stock["losses"][-1]) <= 0.05 * stock["losses"][-1]
        assert sdp["hashes"] != stock["hashes"]
    for step in range(STEPS):
        assert len({r[name]["sdp4bit-own"]["hashes"][step] for _, r in runs}) == 1
