"""``exact_reduce_scatter="alltoall"``: the exact baseline that moves ring bytes on gloo.

gloo's reduce-scatter is a ring all-reduce (twice a ring reduce-scatter's bytes), so
``scripts/bench_slow_link.py``'s ``baseline-a2a`` preset asks the layer, through this
config field (``--sdp4bit-exact-reduce-scatter alltoall``), to run the distributed
optimizer's exact reduce-scatter as one all-to-all plus a local fp32 sum. On 4 gloo
ranks (2 emulated nodes x 2), against stock megatron:

- the same reduced gradients and losses up to the sum's order and rounding (fp32
  here, bf16 for gloo's with bf16 gradients), replicas bit-identical after every
  step, with and without overlap;
- megatron's own reduce-scatter function never ran, and an all-to-all ran for each
  of the reduce-scatters the stock run made (a layer that ignored the option would
  run megatron's instead);
- without the distributed optimizer (megatron all-reduces, so the option would change
  nothing) it is refused at DDP construction with one line naming the flag.
"""
from __future__ import annotations

import pytest

from harness import spawn_ranks
from harness.tiny_gpt import TinyGPTSpec, refusal
from megatron_sdp4bit.config import preset

WORLD = 4
STEPS = 6
ALLTOALL = preset("baseline", ranks_per_node=2, exact_reduce_scatter="alltoall")
SPECS = {
    "bf16": TinyGPTSpec(dtype="bf16"),
    "fp32-overlap-both": TinyGPTSpec(dtype="fp32", overlap_grad_reduce=True,
                                     overlap_param_gather=True, bucket_size=4000),
}


def _train(spec: TinyGPTSpec, config):
    import torch.distributed
    from megatron.core.distributed import param_and_grad_buffer

    from harness.tiny_gpt import TinyGPTTrainer
    from megatron_sdp4bit.megatron import patch
    from megatron_sdp4bit.patching import Patches

    calls = {"megatron_reduce_scatter": 0, "all_to_all": 0}

    def counting(key, function):
        def counted(*args, **kwargs):
            calls[key] += 1
            return function(*args, **kwargs)
        return counted

    patch.uninstall()
    if config is not None:
        patch.install(config)
    trainer = TinyGPTTrainer(spec)
    with Patches("test") as counters:
        counters.set(param_and_grad_buffer, "dist_reduce_scatter_func",
                     counting("megatron_reduce_scatter", param_and_grad_buffer.dist_reduce_scatter_func))
        counters.set(torch.distributed, "all_to_all_single",
                     counting("all_to_all", torch.distributed.all_to_all_single))
        records = trainer.train_steps(1, capture_reduced_grads=True) + trainer.train_steps(STEPS - 1)
    patch.uninstall()
    return {"losses": [r.loss for r in records], "hashes": [r.weights_sha256 for r in records],
            "calls": calls, "buckets": trainer.num_buckets,
            "first_shards": [values for _, _, values in records[0].reduced_grad_shards]}


def _world(rank, world_size):
    runs = {name: {"stock": _train(spec, None), "alltoall": _train(spec, ALLTOALL)}
            for name, spec in SPECS.items()}
    return runs, refusal(ALLTOALL, TinyGPTSpec(use_distributed_optimizer=False))


@pytest.fixture(scope="module")
def world():
    return spawn_ranks(_world, WORLD, timeout_s=900)


def _per_rank(world, name: str):
    """(stock run, all-to-all run) of ``name``, rank by rank."""
    return [(runs[name]["stock"], runs[name]["alltoall"]) for runs, _ in world]


@pytest.mark.parametrize("name", list(SPECS))
def test_alltoall_reduces_and_trains_as_megatrons_exact_reduce_scatter(world, name):
    # The first step's reduced gradients (same weights, same data): equal up to the order
    # of the sum (fp32) or, for bf16 gradients, the all-to-all's single rounding of an
    # fp32 sum against gloo's sum in bf16 (a few bf16 ulps). An unreduced, misplaced or
    # summed-not-averaged shard is off by O(1) of the largest gradient.
    bf16 = SPECS[name].dtype == "bf16"
    for stock, alltoall in _per_rank(world, name):
        for want, got in zip(stock["first_shards"], alltoall["first_shards"]):
            assert (got - want).abs().max() <= (2 ** -6 if bf16 else 1e-6) * want.abs().max()
        assert alltoall["losses"] == pytest.approx(stock["losses"], rel=1e-3 if bf16 else 1e-5)
    for step in range(STEPS):
        assert len({alltoall["hashes"][step] for _, alltoall in _per_rank(world, name)}) == 1


@pytest.mark.parametrize("name", list(SPECS))
def test_megatrons_reduce_scatter_never_ran_and_the_all_to_alls_did(world, name):
    for stock, alltoall in _per_rank(world, name):
        reduce_scatters = stock["calls"]["megatron_reduce_scatter"]
        assert reduce_scatters >= stock["buckets"] * STEPS and stock["calls"]["all_to_all"] == 0
        # each of megatron's reduce-scatters (one per bucket and step) became one all-to-all
        assert alltoall["calls"] == {"megatron_reduce_scatter": 0, "all_to_all": reduce_scatters}


def test_without_the_distributed_optimizer_it_is_refused_naming_the_flag(world):
    for _, message in world:
        assert message is not None and "--sdp4bit-exact-reduce-scatter alltoall" in message
        assert "--use-distributed-optimizer" in message and "\n" not in message
