"""The CPU backend runs megatron-core's GPT + DDP + distributed optimizer on gloo, correctly.

One 4-rank world is spawned once (a module-scoped fixture) and every training run
shares it, because starting ranks and importing megatron cost far more than the runs
(about 10 s of imports against 5 s of training). The tests then check what it returned:

* opt-in idempotence and exact restore; the RNG tracker maps to the CPU generator;
* fp32, overlap on with many buckets and overlap off: trains, all ranks bit-identical,
  and matches a single-process reference (plain autograd + AdamW on the concatenated
  batch) in losses, reduce-scattered gradients and final weights;
* bf16 params with fp32 and bf16 grad buffers, dropout, microbatches, overlap of grad
  reduce and param gather: trains, ranks bit-identical, and dropout runs are
  reproducible from the seed, with or without activation recompute;
* the non-distributed optimizers (their type checks are redirected too) run;
* the harness itself: a failing rank's traceback, a timeout instead of a hang, and
  ``ValueError`` for specs it cannot build.
"""
import logging
import math
import multiprocessing
import time

import pytest
import torch

from harness import RankFailed, spawn_ranks
from harness.tiny_gpt import (
    TinyGPTSpec,
    TinyGPTTrainer,
    assemble_reduced_grads,
    reference_train,
)

WORLD = 4
TIMEOUT_S = 240

FP32_OVERLAP = TinyGPTSpec(overlap_grad_reduce=True, overlap_param_gather=True,
                           bucket_size=10_000)
FP32_PLAIN = TinyGPTSpec()
FP32_STEPS, PLAIN_STEPS, CAPTURED_STEPS = 12, 3, 3

BF16_TRAIN = TinyGPTSpec(dtype="bf16", grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                         bucket_size=20_000, hidden_dropout=0.1, attention_dropout=0.1,
                         num_microbatches=2)
BF16_GATHER = TinyGPTSpec(dtype="bf16", grad_reduce_in_fp32=False, overlap_grad_reduce=True,
                          overlap_param_gather=True, bucket_size=20_000)
BF16_STEPS, REPEAT_STEPS = 15, 4


# ----------------------------------------------------------------- rank-side scenarios


def _patch_points():
    """Every (owner, attribute) the backend must swap, named independently of cpu_backend/."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils as transformer_utils

    points = [(torch.cuda, n) for n in ("current_device", "synchronize", "Stream", "Event",
                                        "stream", "current_stream", "default_stream")]
    points += [(random, "_get_cuda_rng_state"), (random, "_set_cuda_rng_state"),
               (random, "model_parallel_cuda_manual_seed"),
               (tensor_parallel, "model_parallel_cuda_manual_seed"),
               (random.CudaRNGStatesTracker, "add"),
               (logging.getLogger(random.__name__), "filters"),  # megatron's own fork, its warning dropped
               (distrib_optimizer.DistributedOptimizer, "__init__"),
               (optimizer.Float16OptimizerWithFloat16Params, "__init__"),
               (optimizer.FP32Optimizer, "__init__"),
               (grad_scaler.MegatronGradScaler, "__init__"),
               (grad_scaler.DynamicGradScaler, "__init__"),
               (clip_grads, "get_grad_norm_fp32"), (optimizer, "get_grad_norm_fp32"),
               (clip_grads, "clip_grad_by_total_norm_fp32"),
               (optimizer, "clip_grad_by_total_norm_fp32"),
               (clip_grads, "count_zeros_fp32"), (optimizer, "count_zeros_fp32"),
               (schedules, "forward_backward_no_pipelining"),
               (transformer_utils, "get_default_causal_mask"),
               (fused_softmax, "get_default_causal_mask")]
    return points


def _check_enable_disable():
    """Enable twice, disable twice: report what changed and what came back."""
    from megatron_sdp4bit import cpu_backend as cpu

    points = _patch_points()
    before = [getattr(owner, name) for owner, name in points]
    cpu.enable_cpu_backend()
    first = [getattr(owner, name) for owner, name in points]
    cpu.enable_cpu_backend()
    second = [getattr(owner, name) for owner, name in points]
    report = {
        "enabled": cpu.is_cpu_backend_enabled(),
        "unchanged_by_enable": [f"{getattr(o, '__name__', o)}.{n}"
                                for (o, n), b, f in zip(points, before, first) if b is f],
        "second_enable_is_noop": all(f is s for f, s in zip(first, second)),
        "current_device": torch.cuda.current_device(),
    }
    cpu.disable_cpu_backend()
    cpu.disable_cpu_backend()
    after = [getattr(owner, name) for owner, name in points]
    report["not_restored"] = [f"{getattr(o, '__name__', o)}.{n}"
                              for (o, n), b, a in zip(points, before, after) if b is not a]
    report["disabled"] = not cpu.is_cpu_backend_enabled()
    try:
        torch.cuda.current_device()
        report["cuda_raises_again"] = torch.cuda.is_available()
    except (AssertionError, RuntimeError):
        report["cuda_raises_again"] = True
    return report


def _check_rng_tracker(seed=77):
    """The tracker's states are CPU generator states seeded as megatron seeds CUDA ones."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import random

    def first_draws(generator_seed):
        return torch.rand(4, generator=torch.Generator().manual_seed(generator_seed))

    model_parallel_cuda_manual_seed(seed)
    default_draw = torch.rand(4)  # the "default" (data-parallel) state: seed itself
    state_before_fork = torch.get_rng_state()
    warned = []  # what megatron's fork logs (on CPU it would warn at every draw)
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append
    logging.getLogger(random.__name__).addHandler(handler)
    try:
        with get_cuda_rng_tracker().fork():
            mp_draw = torch.rand(4)  # model-parallel state: seed + 2718 + tp_rank
        restored = torch.equal(torch.get_rng_state(), state_before_fork)
        with get_cuda_rng_tracker().fork():
            mp_second_draw = torch.rand(4)  # continues the forked stream, not a restart
    finally:
        logging.getLogger(random.__name__).removeHandler(handler)
    return {
        "fork_silent": not warned,
        "default_ok": torch.equal(default_draw, first_draws(seed)),
        "model_parallel_ok": torch.equal(mp_draw, first_draws(seed + 2718)),
        "restored_outside": restored,
        "fork_continues": torch.equal(
            torch.cat([mp_draw, mp_second_draw]),
            torch.rand(8, generator=torch.Generator().manual_seed(seed + 2718))),
    }


def _summary(records):
    return {"losses": [r.loss for r in records], "hashes": [r.weights_sha256 for r in records],
            "shards": [r.reduced_grad_shards for r in records if r.reduced_grad_shards]}


def _world(rank, world_size):
    result = _fp32_runs(rank, world_size)
    result["bf16"] = _bf16_runs()
    return result


def _fp32_runs(rank, world_size):
    result = {"enable_disable": _check_enable_disable()}
    overlap = TinyGPTTrainer(FP32_OVERLAP)
    result["rng"] = _check_rng_tracker()
    result["overlap_buckets"] = overlap.num_buckets
    records = overlap.train_steps(CAPTURED_STEPS, capture_reduced_grads=True)
    records += overlap.train_steps(FP32_STEPS - CAPTURED_STEPS)
    result["overlap"] = _summary(records)
    result["overlap"]["layout"] = overlap.grad_layout()
    plain = TinyGPTTrainer(FP32_PLAIN)
    result["plain_buckets"] = plain.num_buckets
    result["plain"] = _summary(plain.train_steps(PLAIN_STEPS, capture_reduced_grads=True))
    result["plain"]["layout"] = plain.grad_layout()
    if rank == 0:
        result["overlap_final_weights"] = overlap.named_weights()
        result["reference"] = reference_train(FP32_OVERLAP, world_size, FP32_STEPS)
    return result


def _bf16_runs():
    result = {}
    trainer = TinyGPTTrainer(BF16_TRAIN)
    result["buckets"] = trainer.num_buckets
    result["param_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    result["train"] = _summary(trainer.train_steps(BF16_STEPS))
    result["repeat"] = _summary(TinyGPTTrainer(BF16_TRAIN).train_steps(REPEAT_STEPS))
    other_seed = TinyGPTSpec(**{**BF16_TRAIN.__dict__, "seed": BF16_TRAIN.seed + 1})
    result["other_seed"] = _summary(TinyGPTTrainer(other_seed).train_steps(REPEAT_STEPS))
    result["gather"] = _summary(TinyGPTTrainer(BF16_GATHER).train_steps(REPEAT_STEPS))
    recompute = TinyGPTSpec(**{**BF16_TRAIN.__dict__, "recompute_activations": True})
    result["recompute"] = _summary(TinyGPTTrainer(recompute).train_steps(REPEAT_STEPS))
    for dtype in ("fp32", "bf16"):
        spec = TinyGPTSpec(dtype=dtype, use_distributed_optimizer=False)
        result[f"no_distopt_{dtype}"] = _summary(TinyGPTTrainer(spec).train_steps(REPEAT_STEPS))
    return result


def _hang(rank, world_size):
    time.sleep(600)


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


# ----------------------------------------------------------------------------- worlds


@pytest.fixture(scope="module")
def world():
    return spawn_ranks(_world, WORLD, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def bf16_world(world):
    return [result["bf16"] for result in world]


def _assert_ranks_bit_identical(results, run):
    hashes = [r[run]["hashes"] for r in results]
    assert all(h for h in hashes[0]), f"{run}: a step has no weight hash"
    for rank, rank_hashes in enumerate(hashes[1:], start=1):
        assert rank_hashes == hashes[0], f"{run}: rank {rank} weights differ from rank 0"
    assert len(set(hashes[0])) == len(hashes[0]), f"{run}: weights did not change every step"


def _mean_losses(results, run):
    per_rank = torch.tensor([r[run]["losses"] for r in results], dtype=torch.float64)
    return per_rank.mean(dim=0)


def _assert_trains(results, run, min_drop):
    losses = _mean_losses(results, run)
    assert torch.isfinite(losses).all(), f"{run}: non-finite loss {losses.tolist()}"
    assert losses[-3:].mean() < losses[0] - min_drop, f"{run}: loss {losses.tolist()}"


# ------------------------------------------------------------------------------ tests


def test_enable_twice_is_safe_and_disable_restores_every_original(world):
    for rank, result in enumerate(world):
        report = result["enable_disable"]
        assert report["enabled"] and report["second_enable_is_noop"], (rank, report)
        assert report["unchanged_by_enable"] == [], report["unchanged_by_enable"]
        assert report["current_device"] == "cpu"
        assert report["disabled"] and report["not_restored"] == [], report["not_restored"]
        assert report["cuda_raises_again"]


def test_rng_tracker_forks_cpu_generator_states_seeded_like_megatron(world):
    for rank, result in enumerate(world):
        assert all(result["rng"].values()), (rank, result["rng"])


def test_fp32_overlap_with_many_buckets_trains_and_keeps_ranks_identical(world):
    assert world[0]["overlap_buckets"] >= 6
    assert world[0]["plain_buckets"] == 1
    _assert_ranks_bit_identical(world, "overlap")
    _assert_ranks_bit_identical(world, "plain")
    _assert_trains(world, "overlap", min_drop=0.5)


def test_fp32_matches_single_process_reference_on_concatenated_batch(world):
    ref_losses, ref_grads, ref_weights = world[0]["reference"]
    assert set(world[0]["plain"]["layout"]) == set(ref_weights), "names differ"

    # Losses: the mean of the ranks' mean losses is the mean over the whole batch
    # (measured relative error <= 1e-7).
    for run, steps in (("overlap", FP32_STEPS), ("plain", PLAIN_STEPS)):
        got = _mean_losses(world, run)
        want = torch.tensor(ref_losses[:steps], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (run, got, want)

    # Gradients after the reduce-scatter: each rank's shard, stitched together, is the
    # full batch's gradient -- averaged over ranks (summing would be off by 3x), each
    # element owned by exactly one rank. Step 0 differs only by summation order
    # (measured 9e-7 relative); later steps also inherit the tiny weight differences
    # that Adam amplifies (measured 1.5e-5 on one CPU, 1.4e-4 on another whose BLAS
    # sums in another order). A misplaced or unreduced shard is off by O(1).
    for run in ("overlap", "plain"):
        for step in range(CAPTURED_STEPS):
            grads = assemble_reduced_grads([r[run]["shards"][step] for r in world],
                                           world[0][run]["layout"])
            rtol = 1e-5 if step == 0 else 1e-3
            for name, want in ref_grads[step].items():
                scale = want.abs().max().item()
                err = (grads[name] - want).abs().max().item()
                assert err <= rtol * scale, (run, step, name, err, scale)

    # Weights after 12 AdamW steps on the all-gathered params (measured error 1.4e-5;
    # a stale or misplaced shard would be off by ~lr per step, i.e. ~1e-2).
    final = world[0]["overlap_final_weights"]
    for name, want in ref_weights.items():
        err = (final[name] - want).abs().max().item()
        assert err <= 1e-4, (name, err)


def test_bf16_trains_with_dropout_microbatches_and_overlap(bf16_world):
    assert bf16_world[0]["param_dtypes"] == ["torch.bfloat16"]
    assert bf16_world[0]["buckets"] >= 4
    _assert_ranks_bit_identical(bf16_world, "train")
    _assert_ranks_bit_identical(bf16_world, "gather")
    _assert_trains(bf16_world, "train", min_drop=0.5)
    assert all(math.isfinite(x) for r in bf16_world for x in r["gather"]["losses"])


def test_dropout_training_is_reproducible_from_the_seed(bf16_world):
    for rank, result in enumerate(bf16_world):
        assert result["repeat"]["losses"] == result["train"]["losses"][:REPEAT_STEPS], rank
        assert result["repeat"]["hashes"] == result["train"]["hashes"][:REPEAT_STEPS], rank
        assert result["other_seed"]["losses"] != result["repeat"]["losses"], rank


def test_activation_recompute_replays_dropout_masks_exactly(bf16_world):
    # Recomputation reruns each layer's forward in backward with the saved RNG states
    # (megatron's _get/_set_cuda_rng_state, here the CPU generator): any mask mismatch
    # would change the gradients and therefore the weights.
    for rank, result in enumerate(bf16_world):
        assert result["recompute"]["losses"] == result["train"]["losses"][:REPEAT_STEPS], rank
        assert result["recompute"]["hashes"] == result["train"]["hashes"][:REPEAT_STEPS], rank


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_non_distributed_optimizers_also_run(bf16_world, dtype):
    run = f"no_distopt_{dtype}"
    _assert_ranks_bit_identical(bf16_world, run)
    losses = _mean_losses(bf16_world, run)
    assert torch.isfinite(losses).all() and losses[-1] < losses[0], losses.tolist()


def test_spawn_ranks_reports_the_failing_rank_traceback():
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2.*deliberate failure") as info:
        spawn_ranks(_raise_on_rank_one, 2, timeout_s=60)
    assert "ValueError" in str(info.value)


def test_spawn_ranks_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish _hang within 8s"):
        spawn_ranks(_hang, 2, timeout_s=8)
    assert time.monotonic() - start < 30
    assert multiprocessing.active_children() == [], "ranks left running after the timeout"


@pytest.mark.parametrize("changes, message", [
    (dict(dtype="fp16"), "dtype"),
    (dict(overlap_param_gather=True), "overlap_param_gather needs"),
    (dict(bucket_size=1000), "bucket_size has no effect"),
    (dict(hidden_size=60, num_attention_heads=8), "multiple of num_attention_heads"),
    (dict(attention_dropout=1.0), "attention_dropout"),
])
def test_bad_spec_is_rejected_with_a_message_that_says_what_to_change(changes, message):
    with pytest.raises(ValueError, match=message):
        TinyGPTSpec(**changes)


def test_reference_refuses_what_it_cannot_model():
    with pytest.raises(ValueError, match="fp32 without dropout"):
        reference_train(TinyGPTSpec(dtype="bf16"), WORLD, 1)
    with pytest.raises(ValueError, match="weight_decay=0"):
        reference_train(TinyGPTSpec(weight_decay=0.1), WORLD, 1)
